//! The bundle's stage graph as Graphviz DOT (to be written).
