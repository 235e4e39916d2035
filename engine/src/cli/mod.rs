//! One module per subcommand.
pub mod check;
pub mod generate;
pub mod info;
