//! What every benchmark binary ends with: its points as a fixed-width table on stdout
//! (first column left-aligned, the rest right-aligned, one space apart) and, when a path
//! is given, as pretty JSON; and the `main` of a binary that only runs on CUDA.
use std::path::Path;

/// Prints `points` as a table of `columns` (header, width), each row's cells from
/// `cells`, then writes `points` as JSON to `json` if given.
pub fn report<T: serde::Serialize>(
    columns: &[(&str, usize)],
    points: &[T],
    cells: impl Fn(&T) -> Vec<String>,
    json: Option<impl AsRef<Path>>,
) -> anyhow::Result<()> {
    println!("{}", line(columns, columns.iter().map(|c| c.0.to_string())));
    for p in points {
        let row = cells(p);
        assert_eq!(row.len(), columns.len(), "one cell per column");
        println!("{}", line(columns, row.into_iter()));
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(points)?)?;
    }
    Ok(())
}

fn line(columns: &[(&str, usize)], cells: impl Iterator<Item = String>) -> String {
    let padded: Vec<String> = columns
        .iter()
        .zip(cells)
        .enumerate()
        .map(|(i, ((_, width), cell))| match i {
            0 => format!("{cell:<width$}"),
            _ => format!("{cell:>width$}"),
        })
        .collect();
    padded.join(" ")
}

/// `value` with `decimals` digits after the point: one table cell.
pub fn fixed(value: f64, decimals: usize) -> String {
    format!("{value:.decimals$}")
}

/// The `main` of a benchmark that needs CUDA: `$run()` when built with `--features cuda`,
/// otherwise a message saying why (`$what`) and how to build it, and exit status 2.
#[macro_export]
macro_rules! cuda_main {
    ($run:path, $what:literal) => {
        #[cfg(feature = "cuda")]
        fn main() -> anyhow::Result<()> {
            $run()
        }

        #[cfg(not(feature = "cuda"))]
        fn main() {
            eprintln!(concat!(
                env!("CARGO_BIN_NAME"),
                " ",
                $what,
                ": build with --features cuda"
            ));
            std::process::exit(2);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_padded_like_the_format_strings_they_replace() {
        let columns = [("W", 6), ("M", 5), ("kiln us", 10)];
        let cells = ["nvfp4".to_string(), "16".into(), fixed(12.345, 2)];
        assert_eq!(
            line(&columns, cells.into_iter()),
            format!("{:<6} {:>5} {:>10.2}", "nvfp4", 16, 12.345)
        );
        assert_eq!(fixed(1.0 / 3.0, 3), "0.333");
    }
}
