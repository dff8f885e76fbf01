//! The README's `tool.wasm`: counts the lines of the file at its first argument and writes the count, with a
//! copy of the file, to its second (`tool /data/in.csv /out/result.csv`).
use std::fs;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output] = args.as_slice() else {
        eprintln!("usage: tool INPUT OUTPUT");
        return ExitCode::from(2);
    };
    let text = match fs::read_to_string(input) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("tool: {input}: {err}");
            return ExitCode::FAILURE;
        }
    };
    let lines = text.lines().count();
    if let Err(err) = fs::write(output, format!("lines: {lines}\n{text}")) {
        eprintln!("tool: {output}: {err}");
        return ExitCode::FAILURE;
    }
    println!("{input}: {lines} lines, written to {output}");
    ExitCode::SUCCESS
}
