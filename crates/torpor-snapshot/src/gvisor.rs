//! gVisor checkpoint images: the one module that knows runsc's image layout.
//!
//! runsc (build 20221219) writes `checkpoint.img` as
//!
//! ```text
//! "gVisorSF" | metadata_len u64 BE | metadata JSON | header MAC [32] | frame_size u32 BE
//! { frame_len u32 BE | raw-deflate data }*        (each frame inflates to frame_size bytes,
//!                                                  the last one to at most frame_size)
//! ```
//!
//! Compressed frames hide the redundancy between snapshots, so the store chunks the *inflated*
//! stream ([`InflatingReader`]) and keeps the header verbatim. On restore it writes the frames
//! back as stored (level-0) deflate ([`StoredFrameWriter`]), which runsc restores faster than
//! the original. [`probe`] recognises only a complete, well-formed frame sequence; anything else
//! is chunked as an opaque file by the caller. This module does no chunking and no store I/O.

use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};

use flate2::{Decompress, FlushDecompress, Status};

pub const IMAGE_MAGIC: &[u8; 8] = b"gVisorSF";
/// Largest metadata JSON accepted.
pub const MAX_METADATA_LEN: u64 = 16 * 1024 * 1024 - 64;
/// Largest frame size accepted (runsc uses 1 MiB).
pub const MAX_FRAME_SIZE: u32 = 64 * 1024 * 1024;
const MAC_LEN: usize = 32;
const STORED_BLOCK_MAX: usize = 65_535;

/// Why a file that started like a gVisor image could not be read as one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("frame {frame} inflates to more than the frame size {frame_size}")]
    FrameTooLarge { frame: u64, frame_size: u32 },
    #[error("frame {frame} is not a complete raw-deflate stream")]
    BadDeflate { frame: u64 },
    #[error("frame {frame} is short but not the last one")]
    ShortFrame { frame: u64 },
    #[error("image ends inside frame {frame}")]
    Truncated { frame: u64 },
}

impl ImageError {
    pub fn code(&self) -> &'static str {
        match self {
            ImageError::FrameTooLarge { .. } => "image_frame_too_large",
            ImageError::BadDeflate { .. } => "image_bad_deflate",
            ImageError::ShortFrame { .. } => "image_short_frame",
            ImageError::Truncated { .. } => "image_truncated",
        }
    }

    /// Finds an `ImageError` carried inside an `io::Error` from [`InflatingReader`].
    pub fn from_io(err: &io::Error) -> Option<&ImageError> {
        err.get_ref().and_then(|e| e.downcast_ref::<ImageError>())
    }
}

/// What [`probe`] learnt about a well-formed image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageLayout {
    /// Magic through frame size, verbatim.
    pub header: Vec<u8>,
    pub frame_size: u32,
    pub frames: u64,
    /// Size of the file as written by runsc.
    pub original_size: u64,
}

/// Bytes a frame of `n` plaintext bytes takes as stored deflate.
pub fn stored_deflate_len(n: usize) -> usize {
    let blocks = n.div_ceil(STORED_BLOCK_MAX).max(1);
    n + 5 * blocks
}

fn max_frame_len(frame_size: u32) -> u64 {
    // Deflate never needs more than stored blocks plus a little; anything bigger is garbage.
    stored_deflate_len(frame_size as usize) as u64 + 1024
}

/// Recognises a gVisor image: magic, sane lengths, and a frame sequence that ends exactly at
/// the end of the file. Reads only the header and the frame length words. Returns `Ok(None)`
/// for anything else; the reader's position afterwards is unspecified.
pub fn probe<R: Read + Seek>(file: R) -> io::Result<Option<ImageLayout>> {
    let mut r = BufReader::with_capacity(64 * 1024, file);
    let mut magic = [0u8; 8];
    if !read_full(&mut r, &mut magic)? || &magic != IMAGE_MAGIC {
        return Ok(None);
    }
    let mut len8 = [0u8; 8];
    if !read_full(&mut r, &mut len8)? {
        return Ok(None);
    }
    let meta_len = u64::from_be_bytes(len8);
    if meta_len > MAX_METADATA_LEN {
        return Ok(None);
    }
    let mut header = Vec::with_capacity(16 + meta_len as usize + MAC_LEN + 4);
    header.extend_from_slice(&magic);
    header.extend_from_slice(&len8);
    let mut rest = vec![0u8; meta_len as usize + MAC_LEN + 4];
    if !read_full(&mut r, &mut rest)? {
        return Ok(None);
    }
    if meta_len > 0 && rest[0] != b'{' {
        return Ok(None);
    }
    header.extend_from_slice(&rest);
    let fs_bytes: [u8; 4] = rest[rest.len() - 4..]
        .try_into()
        .map_err(|_| io::Error::other("frame size slice"))?;
    let frame_size = u32::from_be_bytes(fs_bytes);
    if frame_size == 0 || frame_size > MAX_FRAME_SIZE {
        return Ok(None);
    }
    let mut pos = header.len() as u64;
    let mut frames = 0u64;
    loop {
        let mut lw = [0u8; 4];
        let n = read_some(&mut r, &mut lw)?;
        if n == 0 {
            break;
        }
        if n < 4 {
            return Ok(None);
        }
        let flen = u64::from(u32::from_be_bytes(lw));
        if flen == 0 || flen > max_frame_len(frame_size) {
            return Ok(None);
        }
        let end = r.seek(SeekFrom::Current(flen as i64))?;
        let file_len = r.get_mut().seek(SeekFrom::End(0))?;
        if end > file_len {
            return Ok(None);
        }
        r.seek(SeekFrom::Start(end))?;
        pos = end;
        frames += 1;
    }
    Ok(Some(ImageLayout {
        header,
        frame_size,
        frames,
        original_size: pos,
    }))
}

/// Reads until `buf` is full; false on a clean or partial EOF.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    Ok(read_some(r, buf)? == buf.len())
}

fn read_some<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads the inflated stream of an image whose header has already been consumed (position the
/// reader at the first frame length word).
pub struct InflatingReader<R> {
    inner: R,
    frame_size: u32,
    compressed: Vec<u8>,
    out: Vec<u8>,
    pos: usize,
    frame: u64,
    saw_short: bool,
    done: bool,
}

impl<R: Read> InflatingReader<R> {
    pub fn new(inner: R, frame_size: u32) -> Self {
        InflatingReader {
            inner,
            frame_size,
            compressed: Vec::new(),
            out: Vec::with_capacity(frame_size as usize + 1),
            pos: 0,
            frame: 0,
            saw_short: false,
            done: false,
        }
    }

    fn refill(&mut self) -> io::Result<()> {
        let mut lw = [0u8; 4];
        let n = read_some(&mut self.inner, &mut lw)?;
        if n == 0 {
            self.done = true;
            return Ok(());
        }
        let bad = |e: ImageError| io::Error::new(io::ErrorKind::InvalidData, e);
        if n < 4 {
            return Err(bad(ImageError::Truncated { frame: self.frame }));
        }
        if self.saw_short {
            return Err(bad(ImageError::ShortFrame {
                frame: self.frame - 1,
            }));
        }
        let flen = u64::from(u32::from_be_bytes(lw));
        if flen > max_frame_len(self.frame_size) {
            return Err(bad(ImageError::BadDeflate { frame: self.frame }));
        }
        self.compressed.resize(flen as usize, 0);
        if !read_full(&mut self.inner, &mut self.compressed)? {
            return Err(bad(ImageError::Truncated { frame: self.frame }));
        }
        self.out.clear();
        let mut d = Decompress::new(false);
        let status = d
            .decompress_vec(&self.compressed, &mut self.out, FlushDecompress::Finish)
            .map_err(|_| bad(ImageError::BadDeflate { frame: self.frame }))?;
        if self.out.len() > self.frame_size as usize {
            return Err(bad(ImageError::FrameTooLarge {
                frame: self.frame,
                frame_size: self.frame_size,
            }));
        }
        if status != Status::StreamEnd || d.total_in() != flen {
            return Err(bad(ImageError::BadDeflate { frame: self.frame }));
        }
        if self.out.len() < self.frame_size as usize {
            self.saw_short = true;
        }
        self.pos = 0;
        self.frame += 1;
        Ok(())
    }
}

impl<R: Read> Read for InflatingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.out.len() && !self.done {
            self.refill()?;
        }
        let n = buf.len().min(self.out.len() - self.pos);
        buf[..n].copy_from_slice(&self.out[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Writes an image: the stored header, then the inflated stream cut into `frame_size` frames
/// of stored deflate. Call [`StoredFrameWriter::finish`] at the end.
pub struct StoredFrameWriter<W: Write> {
    out: W,
    frame_size: usize,
    buf: Vec<u8>,
    written: u64,
}

impl<W: Write> StoredFrameWriter<W> {
    pub fn new(mut out: W, header: &[u8], frame_size: u32) -> io::Result<Self> {
        out.write_all(header)?;
        Ok(StoredFrameWriter {
            out,
            frame_size: frame_size as usize,
            buf: Vec::with_capacity(frame_size as usize),
            written: header.len() as u64,
        })
    }

    pub fn write_data(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let take = (self.frame_size - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == self.frame_size {
                self.emit()?;
            }
        }
        Ok(())
    }

    pub fn write_zeros(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            let take = ((self.frame_size - self.buf.len()) as u64).min(n) as usize;
            self.buf.resize(self.buf.len() + take, 0);
            n -= take as u64;
            if self.buf.len() == self.frame_size {
                self.emit()?;
            }
        }
        Ok(())
    }

    fn emit(&mut self) -> io::Result<()> {
        let len = stored_deflate_len(self.buf.len());
        self.out.write_all(&(len as u32).to_be_bytes())?;
        let blocks = self.buf.len().div_ceil(STORED_BLOCK_MAX).max(1);
        for (i, block) in self
            .buf
            .chunks(STORED_BLOCK_MAX)
            .chain(std::iter::once(&[][..]).filter(|_| self.buf.is_empty()))
            .enumerate()
        {
            let last = i + 1 == blocks;
            let bl = block.len() as u16;
            self.out.write_all(&[
                u8::from(last),
                bl as u8,
                (bl >> 8) as u8,
                !bl as u8,
                (!bl >> 8) as u8,
            ])?;
            self.out.write_all(block)?;
        }
        self.written += 4 + len as u64;
        self.buf.clear();
        Ok(())
    }

    /// Flushes the last (short) frame; returns the writer and the bytes written in total.
    pub fn finish(mut self) -> io::Result<(W, u64)> {
        if !self.buf.is_empty() {
            self.emit()?;
        }
        self.out.flush()?;
        Ok((self.out, self.written))
    }
}

/// What [`reencode_stored`] did with a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reencoded {
    /// Not a well-formed gVisor image: left alone.
    NotAnImage,
    /// Its frames barely compress (or are stored already): restoring it inflates next to
    /// nothing, so there is nothing to gain. Left alone.
    NothingToGain { size: u64 },
    /// Written to the destination as stored deflate.
    Done { original: u64, written: u64 },
    /// The caller's `room` refused the bytes the stored image would take (at most `needed`).
    NoRoom { needed: u64 },
}

/// Frames that shrink by less than this (compressed / stored) are not worth re-encoding.
const WORTH_REENCODING: f64 = 0.9;

/// Rewrites the image at `src` with every frame as stored (level-0) deflate into `dst` (made
/// or truncated, synced before it returns), the header verbatim: the same inflated stream,
/// which runsc restores without inflating (measured: 233 ms against 353 ms for a Python
/// agent's 17.9 MB of state). Leaves `dst` alone when there is nothing to gain; `dst` may
/// hold a partial image after an error (the caller's temporary file). `room` is asked first
/// whether the stored image may take the bytes it would at most.
pub fn reencode_stored(
    src: &std::path::Path,
    dst: &std::path::Path,
    room: impl FnOnce(u64) -> bool,
) -> io::Result<Reencoded> {
    let Some(layout) = probe(std::fs::File::open(src)?)? else {
        return Ok(Reencoded::NotAnImage);
    };
    // What the frames would take stored, at most (the last one may be short).
    let stored_max = layout.header.len() as u64
        + layout.frames * (4 + stored_deflate_len(layout.frame_size as usize) as u64);
    if layout.frames == 0 || layout.original_size as f64 >= stored_max as f64 * WORTH_REENCODING {
        return Ok(Reencoded::NothingToGain {
            size: layout.original_size,
        });
    }
    if !room(stored_max) {
        return Ok(Reencoded::NoRoom { needed: stored_max });
    }
    let mut file = std::fs::File::open(src)?;
    file.seek(SeekFrom::Start(layout.header.len() as u64))?;
    let mut inflated =
        InflatingReader::new(BufReader::with_capacity(1 << 20, file), layout.frame_size);
    let out = io::BufWriter::with_capacity(1 << 20, std::fs::File::create(dst)?);
    let mut w = StoredFrameWriter::new(out, &layout.header, layout.frame_size)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = inflated.read(&mut buf)?;
        if n == 0 {
            break;
        }
        w.write_data(&buf[..n])?;
    }
    let (out, written) = w.finish()?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(Reencoded::Done {
        original: layout.original_size,
        written,
    })
}

/// Builds an image the way runsc does (deflate-compressed frames). For tests and benchmarks.
pub fn encode_compressed_image(metadata: &[u8], stream: &[u8], frame_size: u32) -> Vec<u8> {
    use flate2::write::DeflateEncoder;
    let mut out = Vec::new();
    out.extend_from_slice(IMAGE_MAGIC);
    out.extend_from_slice(&(metadata.len() as u64).to_be_bytes());
    out.extend_from_slice(metadata);
    out.extend_from_slice(&[0x5a; MAC_LEN]);
    out.extend_from_slice(&frame_size.to_be_bytes());
    for frame in stream.chunks(frame_size as usize) {
        let mut enc = DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        // Writing into a Vec cannot fail.
        let body = enc
            .write_all(frame)
            .and_then(|_| enc.finish())
            .unwrap_or_default();
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn stream(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i / 3) % 251) as u8 ^ (i % 13) as u8)
            .collect()
    }

    fn inflate_all(img: &[u8], layout: &ImageLayout) -> Vec<u8> {
        let mut r = InflatingReader::new(&img[layout.header.len()..], layout.frame_size);
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn probe_inflate_and_restore_stored() {
        let s = stream(300_000);
        let img = encode_compressed_image(b"{\"k\":1}", &s, 65_536);
        let layout = probe(Cursor::new(&img)).unwrap().unwrap();
        assert_eq!(layout.frame_size, 65_536);
        assert_eq!(layout.frames, 5);
        assert_eq!(layout.original_size, img.len() as u64);
        assert_eq!(inflate_all(&img, &layout), s);

        let mut w = StoredFrameWriter::new(Vec::new(), &layout.header, layout.frame_size).unwrap();
        w.write_data(&s[..1000]).unwrap();
        w.write_data(&s[1000..200_000]).unwrap();
        w.write_data(&s[200_000..]).unwrap();
        let (stored, written) = w.finish().unwrap();
        assert_eq!(written, stored.len() as u64);
        let layout2 = probe(Cursor::new(&stored)).unwrap().unwrap();
        assert_eq!(layout2.header, layout.header);
        assert_eq!(layout2.frames, 5);
        assert_eq!(inflate_all(&stored, &layout2), s);
        // Stored frames are also plain raw deflate to any other inflater.
        let first_len = u32::from_be_bytes(stored[layout.header.len()..][..4].try_into().unwrap());
        let body = &stored[layout.header.len() + 4..][..first_len as usize];
        let mut dec = flate2::read::DeflateDecoder::new(body);
        let mut out = Vec::new();
        dec.read_to_end(&mut out).unwrap();
        assert_eq!(out, s[..65_536]);
    }

    #[test]
    fn a_compressed_image_is_rewritten_stored_and_an_incompressible_one_is_left() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("checkpoint.img"), tmp.path().join("stored"));
        // Compressible state (a repeating pattern): rewritten, the same stream, frames stored.
        let s = stream(300_000);
        std::fs::write(&src, encode_compressed_image(b"{\"k\":1}", &s, 65_536)).unwrap();
        let r = reencode_stored(&src, &dst, |_| true).unwrap();
        let Reencoded::Done { original, written } = r else {
            panic!("{r:?}")
        };
        let out = std::fs::read(&dst).unwrap();
        assert_eq!(written, out.len() as u64);
        assert!(
            written > original,
            "stored is larger: {written} vs {original}"
        );
        let layout = probe(Cursor::new(&out)).unwrap().unwrap();
        assert_eq!(layout.frames, 5);
        assert_eq!(inflate_all(&out, &layout), s);
        // Every frame is stored: its length is the stored length of what it inflates to.
        let first = u32::from_be_bytes(out[layout.header.len()..][..4].try_into().unwrap());
        assert_eq!(first as usize, stored_deflate_len(65_536));
        // Stored already: nothing to gain, the destination untouched.
        let again = tmp.path().join("again");
        assert!(matches!(
            reencode_stored(&dst, &again, |_| true).unwrap(),
            Reencoded::NothingToGain { .. }
        ));
        assert!(!again.exists());
        // Incompressible memory (as a sandbox's random bytes): nothing to gain either.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..300_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(&src, encode_compressed_image(b"{}", &noise, 65_536)).unwrap();
        assert!(matches!(
            reencode_stored(&src, &again, |_| true).unwrap(),
            Reencoded::NothingToGain { .. }
        ));
        // No room: asked for the stored size, nothing written.
        std::fs::write(&src, encode_compressed_image(b"{}", &s, 65_536)).unwrap();
        let mut asked = 0;
        let r = reencode_stored(&src, &again, |n| {
            asked = n;
            false
        })
        .unwrap();
        assert_eq!(r, Reencoded::NoRoom { needed: asked });
        assert!(asked >= 300_000 && !again.exists(), "{asked}");
        // Not an image at all.
        std::fs::write(&src, b"not an image").unwrap();
        assert_eq!(
            reencode_stored(&src, &again, |_| true).unwrap(),
            Reencoded::NotAnImage
        );
    }

    #[test]
    fn zeros_and_exact_frame_multiples() {
        let header = encode_compressed_image(b"{}", &[], 1024);
        let layout = probe(Cursor::new(&header)).unwrap().unwrap();
        assert_eq!(layout.frames, 0);
        let mut w = StoredFrameWriter::new(Vec::new(), &layout.header, 1024).unwrap();
        w.write_zeros(2048).unwrap();
        let (img, _) = w.finish().unwrap();
        let l = probe(Cursor::new(&img)).unwrap().unwrap();
        assert_eq!(l.frames, 2);
        assert_eq!(inflate_all(&img, &l), vec![0u8; 2048]);
    }

    #[test]
    fn unknown_or_broken_files_are_not_images() {
        assert_eq!(
            probe(Cursor::new(b"hello world, not an image")).unwrap(),
            None
        );
        let img = encode_compressed_image(b"{}", &stream(200_000), 65_536);
        assert_eq!(probe(Cursor::new(&img[..img.len() - 1])).unwrap(), None);
        let mut extra = img.clone();
        extra.extend_from_slice(&[1, 2]);
        assert_eq!(probe(Cursor::new(&extra)).unwrap(), None);
        let mut huge_meta = img.clone();
        huge_meta[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(probe(Cursor::new(&huge_meta)).unwrap(), None);
    }

    #[test]
    fn garbage_frames_fail_with_image_errors() {
        let mut img = encode_compressed_image(b"{}", &stream(200_000), 65_536);
        let layout = probe(Cursor::new(&img)).unwrap().unwrap();
        let at = layout.header.len() + 4;
        img[at] = 0xff; // invalid block type
        img[at + 1] = 0xff;
        let mut r = InflatingReader::new(&img[layout.header.len()..], layout.frame_size);
        let err = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(ImageError::from_io(&err).is_some(), "{err}");

        // A frame that inflates past the frame size (a deflate bomb) is refused.
        let bomb = encode_compressed_image(b"{}", &vec![0u8; 1 << 20], 1 << 20);
        let layout = probe(Cursor::new(&bomb)).unwrap().unwrap();
        let mut r = InflatingReader::new(&bomb[layout.header.len()..], 4096);
        let err = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(matches!(
            ImageError::from_io(&err),
            Some(ImageError::FrameTooLarge { .. }) | Some(ImageError::BadDeflate { .. })
        ));
    }
}
