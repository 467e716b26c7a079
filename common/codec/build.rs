//! Compiles the payload messages (`proto/cleave/v1/payload.proto`) with a vendored protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=../../proto/cleave/v1/payload.proto");
    prost_build::Config::new()
        // Envelope and header bytes stay `Bytes`: the header is authenticated as received.
        .bytes([".cleave.v1.PayloadEnvelope"])
        .compile_protos(&["../../proto/cleave/v1/payload.proto"], &["../../proto"])?;
    Ok(())
}
