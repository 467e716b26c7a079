//! Links libtorch (see `link_torch.rs`) and compiles the gRPC service from `proto/`.

#[path = "link_torch.rs"]
mod link_torch;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    link_torch::link_torch();
    // Any rerun-if line replaces cargo's default (rerun when the package changes), and the
    // proto lives outside the package, so it is named here.
    println!("cargo:rerun-if-changed=../proto/cleave/v1/cleave.proto");
    println!("cargo:rerun-if-changed=../proto/cleave/v1/payload.proto");
    // A vendored protoc, so that a fresh machine needs no system package.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        // Tensor bytes stay `bytes::Bytes`: decoding a frame does not copy them.
        .bytes(".cleave.v1")
        // The codec's own (payload.proto), not a second copy.
        .extern_path(".cleave.v1.SealedMessage", "::cleave_codec::pb::SealedMessage")
        .compile_protos(&["../proto/cleave/v1/cleave.proto"], &["../proto"])?;
    Ok(())
}
