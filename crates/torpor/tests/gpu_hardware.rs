//! The GPU path on a real NVIDIA machine (ignored here: no GPU; scripts/gpu-check.sh runs it).
//! Needs root, an NVIDIA driver, a runsc with `--nvproxy`, `cuda-checkpoint` on PATH (or
//! TORPOR_CUDA_CHECKPOINT) and python3 with the host's libcuda visible to the `host` template.
//! A sandbox holding a whole GPU creates a CUDA context, is parked (cuda-checkpoint toggles
//! the context out inside the sandbox, then gVisor checkpoints), is woken (restore, toggle
//! back), and the same process still has a working context.

mod common;

use common::{sh, Daemon};
use serde_json::json;
use torpor_api::types::CreateSandboxBody;
use torpor_core::Tier;

const CUDA_PROGRAM: &str = r#"
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
ptr = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20) == 0
open("/tmp/cuda-ready", "w").write("ok")
while True:
    time.sleep(0.5)
    # A failing call after the wake means the context did not come back.
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    open("/tmp/cuda-rc", "w").write(str(rc))
"#;

#[tokio::test]
#[ignore = "needs an NVIDIA GPU, runsc with nvproxy, cuda-checkpoint and root"]
async fn a_cuda_context_survives_park_and_wake_with_cuda_checkpoint() {
    let d = Daemon::start().await;
    let c = d.client();
    let status = c.gpus().await.expect("this node has NVML GPUs");
    assert_eq!(status["source"], "nvml", "{status}");
    assert_eq!(
        status["cuda_checkpoint"], true,
        "cuda-checkpoint must be installed"
    );
    let id = c
        .create_sandbox(&CreateSandboxBody {
            template: "host".into(),
            gpu: Some(json!({"mode": "whole"})),
            ..Default::default()
        })
        .await
        .expect("a GPU sandbox starts (runsc needs --nvproxy)")
        .id;
    let body = sh(&format!(
        "cat > /tmp/cuda.py <<'EOF'\n{CUDA_PROGRAM}\nEOF\nnohup python3 /tmp/cuda.py >/tmp/cuda.log 2>&1 &"
    ));
    let r = c.exec(&id, &body).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let mut ready = false;
    for _ in 0..100 {
        let r = c
            .exec(&id, &sh("cat /tmp/cuda-ready 2>/dev/null"))
            .await
            .unwrap();
        if r.stdout.trim() == "ok" {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let log = c.exec(&id, &sh("cat /tmp/cuda.log")).await.unwrap().stdout;
    assert!(ready, "the CUDA program did not start: {log}");
    c.suspend(&id, Some(Tier::Parked))
        .await
        .expect("park with cuda-checkpoint");
    // Wake: the restore toggles the context back; the program's next CUDA call succeeds.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let r = c
        .exec(&id, &sh("sleep 2; cat /tmp/cuda-rc; pgrep -f cuda.py"))
        .await
        .unwrap();
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("0"), "{r:?}");
    assert!(lines.next().is_some(), "the CUDA process survived: {r:?}");
    c.delete_sandbox(&id).await.unwrap();
}
