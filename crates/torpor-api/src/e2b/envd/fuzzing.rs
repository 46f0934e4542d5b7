//! Fuzz entry points for envd's `process.Process/*` request messages: each method's message
//! decoded the way [`super::process_rpc`] decodes it, and the checks made on it before the
//! sandbox is asked anything. Reached through `crate::fuzzing`; not part of the API.

use super::*;

/// The methods of `process.Process` that are served, and whether each is a stream.
pub const PROCESS_METHODS: &[(&str, bool)] = &[
    ("Start", true),
    ("Connect", true),
    ("StreamInput", true),
    ("List", false),
    ("SendInput", false),
    ("SendSignal", false),
    ("CloseStdin", false),
    ("Update", false),
];

/// The stdin or terminal bytes of an input, base64-decoded as [`super::write_input`] does.
fn input_bytes(input: ProcessInput) -> Result<Vec<u8>, RpcError> {
    let (raw, field) = match (input.stdin, input.pty) {
        (_, Some(p)) => (p, "input.pty"),
        (s, None) => (s.unwrap_or_default(), "input.stdin"),
    };
    base64::engine::general_purpose::STANDARD
        .decode(raw)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("{field}: {e}")))
}

/// What a selector names before any process is looked up (a pid, or a tag to look up).
fn selector(sel: Option<Selector>) -> Result<(), RpcError> {
    let sel =
        sel.ok_or_else(|| RpcError::new(Code::InvalidArgument, "process selector is required"))?;
    if sel.pid.is_none() && sel.tag.is_none() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "process selector needs pid or tag",
        ));
    }
    Ok(())
}

/// `body` as the request of `process.Process/{method}` framed as `framing` (for
/// `StreamInput`, its whole client stream arriving in `chunks` of the given sizes, cycled):
/// the method and framing checked, the message parsed, and what the handler checks before it
/// reaches the sandbox (selector, pty size, command, working directory, base64 input, signal).
pub fn process_message(
    method: &str,
    framing: Framing,
    body: &[u8],
    chunks: &[usize],
) -> Result<(), RpcError> {
    let streaming = matches!(method, "Start" | "Connect" | "StreamInput");
    let known = PROCESS_METHODS.iter().any(|(m, _)| *m == method);
    connect::check_method("process.Process", method, known, streaming, framing)?;
    match method {
        "Start" => {
            let (req, _, config) = parse_start(body)?;
            if let Some(d) = config.cwd.as_deref().filter(|d| !d.is_empty()) {
                super::super::paths::resolve(d, None)?;
            }
            // What the handler records about the process must serialise.
            serde_json::to_vec(&Recorded {
                config,
                tag: req.tag,
                pty: req.pty.is_some(),
            })
            .map_err(|e| RpcError::new(Code::Internal, e.to_string()))?;
            Ok(())
        }
        "Connect" | "CloseStdin" => {
            let req: SelectorRequest = connect::parse_request(framing, body)?;
            selector(req.process)
        }
        "List" => Ok(()),
        "SendInput" => {
            let req: SendInputRequest = connect::parse_request(framing, body)?;
            selector(req.process)?;
            input_bytes(req.input.unwrap_or_default()).map(|_| ())
        }
        "SendSignal" => {
            let req: SendSignalRequest = connect::parse_request(framing, body)?;
            parse_signal(req.signal.as_ref())?;
            selector(req.process)
        }
        "Update" => {
            let req: UpdateRequest = connect::parse_request(framing, body)?;
            selector(req.process)?;
            req.pty.as_ref().map(PtyRequest::size).transpose()?;
            Ok(())
        }
        "StreamInput" => stream_input(body, chunks),
        _ => unreachable!("checked by check_method"),
    }
}

/// `StreamInput`'s client stream, decoded as [`super::write_stream_input`] decodes it: the
/// body pushed to an [`connect::EnvelopeDecoder`] in chunks, each message parsed once its
/// envelope is complete (`start`, `data` or `keepalive`), a `data` before any `start` refused.
fn stream_input(body: &[u8], chunks: &[usize]) -> Result<(), RpcError> {
    // The handler's message type is local to it; this is the same shape.
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    struct StreamInputRequest {
        start: Option<SelectorRequest>,
        data: Option<SendInputRequest>,
        keepalive: Option<serde_json::Value>,
    }
    let mut decoder = connect::EnvelopeDecoder::default();
    let mut rest = body;
    let mut sizes = chunks.iter().copied().filter(|n| *n > 0).cycle();
    let mut started = false;
    loop {
        let msg = match decoder.next_envelope()? {
            Some(connect::Envelope::Message(m)) => m,
            Some(connect::Envelope::End(_)) => break,
            None if rest.is_empty() => {
                decoder.finish()?;
                break;
            }
            None => {
                let n = sizes.next().unwrap_or(rest.len()).min(rest.len());
                decoder.push(&rest[..n]);
                rest = &rest[n..];
                continue;
            }
        };
        assert!(
            msg.len() <= connect::MAX_MESSAGE,
            "the decoder passed a message over MAX_MESSAGE"
        );
        let msg = if msg.is_empty() { &b"{}"[..] } else { &msg[..] };
        let m: StreamInputRequest = serde_json::from_slice(msg)
            .map_err(|e| RpcError::new(Code::InvalidArgument, format!("request message: {e}")))?;
        if let Some(start) = m.start {
            selector(start.process)?;
            started = true;
        } else if let Some(data) = m.data {
            if !started {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "the first StreamInput message must be start",
                ));
            }
            input_bytes(data.input.unwrap_or_default())?;
        } else if m.keepalive.is_none() {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "a StreamInput message needs start, data or keepalive",
            ));
        }
    }
    if !started {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "StreamInput needs a start message naming the process",
        ));
    }
    Ok(())
}
