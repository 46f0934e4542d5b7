//! Samples ([`GpuSample`]) as metrics under DCGM exporter's names and labels, so existing
//! dashboards work. Pure: tested without a GPU.

use std::fmt::Write as _;

/// One GPU's (or MIG instance's) readings, for [`dcgm_metrics`].
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub gpu: u32,
    pub uuid: String,
    pub model_name: String,
    /// `(GPU_I_PROFILE, GPU_I_ID)` for a MIG instance.
    pub mig: Option<(String, u32)>,
    pub tenant: Option<String>,
    pub sandbox: Option<String>,
    pub util_pct: Option<u32>,
    pub fb_used_mib: Option<u64>,
    pub temp_c: Option<u32>,
    pub power_w: Option<f64>,
    pub tensor_active: Option<f64>,
    pub xid_last: Option<u64>,
    pub ecc_dbe_volatile: Option<u64>,
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Metrics under DCGM exporter's names and labels, so existing dashboards work.
pub fn dcgm_metrics(hostname: &str, samples: &[GpuSample]) -> String {
    type Reading = fn(&GpuSample) -> Option<String>;
    let families: [(&str, &str, &str, Reading); 7] = [
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "gauge",
            "GPU utilization (in %).",
            |s| s.util_pct.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "gauge",
            "Framebuffer memory used (in MiB).",
            |s| s.fb_used_mib.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_GPU_TEMP",
            "gauge",
            "GPU temperature (in C).",
            |s| s.temp_c.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_POWER_USAGE",
            "gauge",
            "Power draw (in W).",
            |s| s.power_w.map(|v| format!("{v:.3}")),
        ),
        (
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
            "gauge",
            "Ratio of cycles the tensor (HMMA) pipe is active.",
            |s| s.tensor_active.map(|v| format!("{v:.6}")),
        ),
        (
            "DCGM_FI_DEV_XID_ERRORS",
            "gauge",
            "Value of the last XID error encountered.",
            |s| s.xid_last.map(|v| v.to_string()),
        ),
        (
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "counter",
            "Total number of double-bit volatile ECC errors.",
            |s| s.ecc_dbe_volatile.map(|v| v.to_string()),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, read) in families {
        let values: Vec<(&GpuSample, String)> = samples
            .iter()
            .filter_map(|s| read(s).map(|v| (s, v)))
            .collect();
        if values.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (s, value) in values {
            let mut labels = format!(
                "gpu=\"{}\",UUID=\"{}\",device=\"nvidia{}\",modelName=\"{}\",Hostname=\"{}\"",
                s.gpu,
                escape(&s.uuid),
                s.gpu,
                escape(&s.model_name),
                escape(hostname)
            );
            if let Some((profile, id)) = &s.mig {
                let _ = write!(
                    labels,
                    ",GPU_I_PROFILE=\"{}\",GPU_I_ID=\"{id}\"",
                    escape(profile)
                );
            }
            if let Some(t) = &s.tenant {
                let _ = write!(labels, ",tenant=\"{}\"", escape(t));
            }
            if let Some(sb) = &s.sandbox {
                let _ = write!(labels, ",sandbox=\"{}\"", escape(sb));
            }
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
    out
}

/// DCGM's `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` is a ratio (0..1); NVML's GPM gives a percentage.
pub fn tensor_ratio(percent: f64) -> f64 {
    if percent.is_finite() {
        (percent / 100.0).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_percent_becomes_dcgm_ratio() {
        assert_eq!(tensor_ratio(25.0), 0.25);
        assert_eq!(tensor_ratio(0.0), 0.0);
        assert_eq!(tensor_ratio(100.4), 1.0);
        assert_eq!(tensor_ratio(f64::NAN), 0.0);
    }

    #[test]
    fn dcgm_metrics_use_exporter_names_and_labels() {
        let text = dcgm_metrics(
            "node-1",
            &[
                GpuSample {
                    gpu: 0,
                    uuid: "GPU-0".into(),
                    model_name: "NVIDIA H200".into(),
                    mig: None,
                    tenant: None,
                    sandbox: None,
                    util_pct: Some(42),
                    fb_used_mib: Some(1024),
                    temp_c: Some(51),
                    power_w: Some(312.5),
                    tensor_active: None,
                    xid_last: None,
                    ecc_dbe_volatile: Some(0),
                },
                GpuSample {
                    gpu: 1,
                    uuid: "GPU-1".into(),
                    model_name: "NVIDIA H200".into(),
                    mig: Some(("3g.71gb".into(), 2)),
                    tenant: Some("team-a".into()),
                    sandbox: Some("sb-1".into()),
                    util_pct: Some(7),
                    fb_used_mib: None,
                    temp_c: None,
                    power_w: None,
                    tensor_active: Some(0.25),
                    xid_last: None,
                    ecc_dbe_volatile: None,
                },
            ],
        );
        assert!(text.contains("# TYPE DCGM_FI_DEV_GPU_UTIL gauge"));
        assert!(text.contains("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-0\",device=\"nvidia0\",modelName=\"NVIDIA H200\",Hostname=\"node-1\"} 42"), "{text}");
        assert!(
            text.contains(
                "GPU_I_PROFILE=\"3g.71gb\",GPU_I_ID=\"2\",tenant=\"team-a\",sandbox=\"sb-1\"} 7"
            ),
            "{text}"
        );
        assert!(text.contains("DCGM_FI_DEV_POWER_USAGE{gpu=\"0\""), "{text}");
        assert!(
            text.contains("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{gpu=\"1\""),
            "{text}"
        );
        assert!(
            !text.contains("DCGM_FI_DEV_XID_ERRORS"),
            "families without readings are left out"
        );
    }
}
