//! cleave common library.
