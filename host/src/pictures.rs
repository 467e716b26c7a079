//! Plots of a run (to be written).
