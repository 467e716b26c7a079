fn main() { let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu)); }
