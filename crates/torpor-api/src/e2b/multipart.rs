//! A small multipart/form-data reader for envd's `/files` upload (bodies are already whole in
//! memory, capped by the router's body limit).

/// The boundary named by a `multipart/form-data; boundary=...` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    content_type.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_string())
            .filter(|b| !b.is_empty() && b.len() <= 200)
    })
}

#[derive(Debug, PartialEq)]
pub struct Part<'a> {
    pub name: Option<String>,
    pub filename: Option<String>,
    pub data: &'a [u8],
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    // Linear in the body (a naive window scan is body x boundary: seconds for 256 MiB).
    memchr::memmem::find(&hay[from..], needle).map(|p| p + from)
}

fn param(disposition: &str, key: &str) -> Option<String> {
    disposition.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        (k.trim().eq_ignore_ascii_case(key)).then(|| v.trim().trim_matches('"').to_string())
    })
}

/// The parts of a multipart body.
pub fn parse<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, String> {
    let delim = format!("--{boundary}");
    let mut pos = find(body, delim.as_bytes(), 0).ok_or("multipart body has no boundary line")?;
    let mut parts = Vec::new();
    loop {
        pos += delim.len();
        if body[pos..].starts_with(b"--") {
            return Ok(parts);
        }
        if !body[pos..].starts_with(b"\r\n") {
            return Err("malformed multipart boundary line".into());
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("multipart part without headers end")?;
        let head = std::str::from_utf8(&body[pos..head_end])
            .map_err(|_| "multipart headers are not UTF-8")?;
        let disposition = head
            .split("\r\n")
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-disposition")
                    .then_some(v.trim())
            })
            .unwrap_or("");
        let data_start = head_end + 4;
        let next = find(body, format!("\r\n{delim}").as_bytes(), data_start)
            .ok_or("multipart part is not terminated")?;
        parts.push(Part {
            name: param(disposition, "name"),
            filename: param(disposition, "filename"),
            data: &body[data_start..next],
        });
        if parts.len() > 1000 {
            return Err("too many multipart parts".into());
        }
        pos = next + 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_parts_and_refuses_broken_bodies() {
        let ct = "multipart/form-data; boundary=XyZ";
        let b = boundary(ct).unwrap();
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/a/b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\nworld\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c\"\r\n\r\n\r\n--XyZ--\r\n";
        let parts = parse(body, &b).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].filename.as_deref(), Some("/a/b.txt"));
        assert_eq!(parts[0].data, b"hello\r\nworld");
        assert_eq!(parts[1].data, b"");
        assert!(parse(b"--XyZ\r\nContent-Disposition: x\r\n\r\nno end", &b).is_err());
        assert!(parse(b"nothing", &b).is_err());
        assert!(parse(b"--XyZjunk", &b).is_err());
        assert_eq!(boundary("multipart/form-data"), None);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = parse(&body, "b");
        }
    }
}
