//! Devices as users write them (`auto`, `cpu`, `cuda`, `cuda:N`) and what they resolve to.

use std::fmt;
use std::str::FromStr;

use crate::error::{BundleError, Result};

/// A device as written in a config or on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The first CUDA device if there is one, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA device N; an error where it does not exist (never a silent CPU run).
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = BundleError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => {
                other.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Self::Cuda).ok_or_else(|| BundleError::InvalidDevice(s.to_string()))
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// The libtorch device this resolves to here.
    pub fn resolve(self) -> Result<tch::Device> {
        match self {
            Self::Auto => Ok(tch::Device::cuda_if_available()),
            Self::Cpu => Ok(tch::Device::Cpu),
            Self::Cuda(n) => {
                let count = if tch::Cuda::is_available() { tch::Cuda::device_count() } else { 0 };
                if (n as i64) < count {
                    Ok(tch::Device::Cuda(n))
                } else {
                    Err(BundleError::DeviceUnavailable { requested: self.to_string(), reason: format!("libtorch sees {count} CUDA device(s)") })
                }
            }
        }
    }
}

/// A short name for a resolved device (`cpu`, `cuda:0`).
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cuda(n) => format!("cuda:{n}"),
        tch::Device::Cpu => "cpu".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("auto".parse::<DeviceSpec>().unwrap(), DeviceSpec::Auto);
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(matches!(err, BundleError::InvalidDevice(ref s) if s == bad), "{bad}: {err}");
        }
    }

    #[test]
    fn cpu_resolves_to_cpu() {
        assert_eq!(DeviceSpec::Cpu.resolve().unwrap(), tch::Device::Cpu);
    }

    #[test]
    fn missing_cuda_device_is_an_error_not_a_cpu_run() {
        let count = if tch::Cuda::is_available() { tch::Cuda::device_count() as usize } else { 0 };
        let err = DeviceSpec::Cuda(count).resolve().unwrap_err();
        assert!(err.to_string().contains(&format!("cuda:{count} is not available")), "{err}");
    }
}
