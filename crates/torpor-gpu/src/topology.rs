//! The GPU-to-GPU topology matrix and the pair score derived from it.
//!
//! The matrix is the GPU part of `nvidia-smi topo -m`: a header of `GPU0 … GPUn-1`, then one
//! row per GPU whose cells are `X` on the diagonal and one of `NV#`, `PIX`, `PXB`, `PHB`,
//! `NODE`, `SYS` elsewhere (`SOC`, the old spelling of `SYS`, is accepted). This module owns
//! parsing and scoring; it knows nothing about allocations.
//!
//! Pair scores (higher is closer) follow MIG-GEOMETRY.md: SYS 10, NODE 20, PHB 30, PXB 40,
//! PIX 50, plus 100 for each NVLink. An `NV#` cell hides the PCIe path between the two GPUs,
//! so an NVLinked pair gets `100 * #` plus NODE when both GPUs share a NUMA node and SYS when
//! they do not; that breaks ties between NVLinked pairs by socket.

use std::fmt;

use crate::ids::GpuIndex;

/// How two GPUs are connected, as one cell of `nvidia-smi topo -m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// `X`: the GPU itself.
    SelfLink,
    /// `NV#`: a bonded set of `#` NVLinks.
    NvLink(u16),
    /// `PIX`: at most one PCIe bridge.
    Pix,
    /// `PXB`: several PCIe bridges, no host bridge.
    Pxb,
    /// `PHB`: through a PCIe host bridge (the CPU).
    Phb,
    /// `NODE`: across host bridges within one NUMA node.
    Node,
    /// `SYS`: across the SMP interconnect between NUMA nodes.
    Sys,
}

/// Score of a pair connected over the SMP interconnect (`SYS`).
pub const SCORE_SYS: u32 = 10;
/// Score of a pair within one NUMA node across host bridges (`NODE`).
pub const SCORE_NODE: u32 = 20;
/// Score of a pair through one host bridge (`PHB`).
pub const SCORE_PHB: u32 = 30;
/// Score of a pair across several PCIe bridges (`PXB`).
pub const SCORE_PXB: u32 = 40;
/// Score of a pair behind one PCIe switch (`PIX`).
pub const SCORE_PIX: u32 = 50;
/// Extra score for each NVLink between a pair.
pub const SCORE_PER_NVLINK: u32 = 100;
/// Score of two shares on the same GPU: closer than any link.
pub const SCORE_SAME_GPU: u32 = 1_000_000;

impl Link {
    /// Parses one matrix cell.
    pub fn parse(cell: &str) -> Option<Link> {
        match cell {
            "X" => Some(Link::SelfLink),
            "PIX" => Some(Link::Pix),
            "PXB" => Some(Link::Pxb),
            "PHB" => Some(Link::Phb),
            "NODE" => Some(Link::Node),
            "SYS" | "SOC" => Some(Link::Sys),
            _ => {
                let count = cell.strip_prefix("NV")?;
                if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                match count.parse::<u16>() {
                    Ok(n) if n > 0 => Some(Link::NvLink(n)),
                    _ => None,
                }
            }
        }
    }

    /// Pair score of this link; `same_numa` matters only for NVLink (see the module doc).
    pub fn score(self, same_numa: bool) -> u32 {
        match self {
            Link::SelfLink => SCORE_SAME_GPU,
            Link::NvLink(n) => {
                let base = if same_numa { SCORE_NODE } else { SCORE_SYS };
                SCORE_PER_NVLINK * u32::from(n) + base
            }
            Link::Pix => SCORE_PIX,
            Link::Pxb => SCORE_PXB,
            Link::Phb => SCORE_PHB,
            Link::Node => SCORE_NODE,
            Link::Sys => SCORE_SYS,
        }
    }

    pub fn is_nvlink(self) -> bool {
        matches!(self, Link::NvLink(_))
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::SelfLink => f.write_str("X"),
            Link::NvLink(n) => write!(f, "NV{n}"),
            Link::Pix => f.write_str("PIX"),
            Link::Pxb => f.write_str("PXB"),
            Link::Phb => f.write_str("PHB"),
            Link::Node => f.write_str("NODE"),
            Link::Sys => f.write_str("SYS"),
        }
    }
}

/// Why a topology block was refused. Lines count from 1 within the block, ignoring nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("the topology matrix is empty")]
    Empty,
    #[error("line {line}: header column {column} is {found:?}, expected \"GPU{expected}\"")]
    BadHeader {
        line: usize,
        column: usize,
        found: String,
        expected: usize,
    },
    #[error("the matrix has {found} rows for {expected} header columns")]
    RowCount { expected: usize, found: usize },
    #[error("line {line}: row label is {found:?}, expected \"GPU{expected}\"")]
    BadRowLabel {
        line: usize,
        found: String,
        expected: usize,
    },
    #[error("line {line}: row has {found} cells, expected {expected}")]
    RowWidth {
        line: usize,
        expected: usize,
        found: usize,
    },
    #[error(
        "line {line}: cell {cell:?} for GPU{column} is not one of X, NV#, PIX, PXB, PHB, NODE, SYS"
    )]
    UnknownLink {
        line: usize,
        column: usize,
        cell: String,
    },
    #[error("GPU{gpu}: the diagonal cell must be X")]
    DiagonalNotSelf { gpu: usize },
    #[error("GPU{row} to GPU{column}: X is only allowed on the diagonal")]
    SelfOffDiagonal { row: usize, column: usize },
    #[error("GPU{a} to GPU{b} is {ab} but GPU{b} to GPU{a} is {ba}")]
    Asymmetric {
        a: usize,
        b: usize,
        ab: String,
        ba: String,
    },
}

impl TopologyError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            TopologyError::Empty => "topology_empty",
            TopologyError::BadHeader { .. } => "topology_bad_header",
            TopologyError::RowCount { .. } => "topology_row_count",
            TopologyError::BadRowLabel { .. } => "topology_bad_row_label",
            TopologyError::RowWidth { .. } => "topology_row_width",
            TopologyError::UnknownLink { .. } => "topology_unknown_link",
            TopologyError::DiagonalNotSelf { .. } => "topology_diagonal_not_self",
            TopologyError::SelfOffDiagonal { .. } => "topology_self_off_diagonal",
            TopologyError::Asymmetric { .. } => "topology_asymmetric",
        }
    }
}

/// A square, symmetric matrix of links between the GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyMatrix {
    size: usize,
    links: Vec<Link>,
}

impl TopologyMatrix {
    /// The matrix of a node with one GPU.
    pub fn single() -> Self {
        TopologyMatrix {
            size: 1,
            links: vec![Link::SelfLink],
        }
    }

    /// Builds a matrix from a link function; `X` is forced on the diagonal.
    pub fn from_fn(size: usize, mut link: impl FnMut(usize, usize) -> Link) -> Self {
        let mut links = Vec::with_capacity(size * size);
        for row in 0..size {
            for column in 0..size {
                links.push(if row == column {
                    Link::SelfLink
                } else {
                    link(row.min(column), row.max(column))
                });
            }
        }
        TopologyMatrix { size, links }
    }

    /// Parses the GPU part of `nvidia-smi topo -m`.
    pub fn parse(text: &str) -> Result<Self, TopologyError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty());
        let (header_line, header) = lines.next().ok_or(TopologyError::Empty)?;
        let columns: Vec<&str> = header.split_whitespace().collect();
        for (column, found) in columns.iter().enumerate() {
            if *found != format!("GPU{column}") {
                return Err(TopologyError::BadHeader {
                    line: header_line,
                    column: column + 1,
                    found: (*found).to_owned(),
                    expected: column,
                });
            }
        }
        let size = columns.len();
        let rows: Vec<(usize, &str)> = lines.collect();
        if rows.len() != size {
            return Err(TopologyError::RowCount {
                expected: size,
                found: rows.len(),
            });
        }
        let mut links = Vec::with_capacity(size * size);
        for (row, (line, text)) in rows.iter().enumerate() {
            let mut cells = text.split_whitespace();
            let label = cells.next().unwrap_or_default();
            if label != format!("GPU{row}") {
                return Err(TopologyError::BadRowLabel {
                    line: *line,
                    found: label.to_owned(),
                    expected: row,
                });
            }
            let cells: Vec<&str> = cells.collect();
            if cells.len() != size {
                return Err(TopologyError::RowWidth {
                    line: *line,
                    expected: size,
                    found: cells.len(),
                });
            }
            for (column, cell) in cells.iter().enumerate() {
                let link = Link::parse(cell).ok_or_else(|| TopologyError::UnknownLink {
                    line: *line,
                    column,
                    cell: (*cell).to_owned(),
                })?;
                match (row == column, link == Link::SelfLink) {
                    (true, false) => return Err(TopologyError::DiagonalNotSelf { gpu: row }),
                    (false, true) => return Err(TopologyError::SelfOffDiagonal { row, column }),
                    _ => {}
                }
                links.push(link);
            }
        }
        let matrix = TopologyMatrix { size, links };
        for a in 0..size {
            for b in (a + 1)..size {
                let (ab, ba) = (matrix.links[a * size + b], matrix.links[b * size + a]);
                if ab != ba {
                    return Err(TopologyError::Asymmetric {
                        a,
                        b,
                        ab: ab.to_string(),
                        ba: ba.to_string(),
                    });
                }
            }
        }
        Ok(matrix)
    }

    /// Number of GPUs in the matrix.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The link between two GPUs; `None` when either index is outside the matrix.
    pub fn link(&self, a: GpuIndex, b: GpuIndex) -> Option<Link> {
        let (a, b) = (a.0 as usize, b.0 as usize);
        if a >= self.size || b >= self.size {
            return None;
        }
        Some(self.links[a * self.size + b])
    }

    /// Renders the matrix in the layout it was parsed from.
    pub fn render(&self) -> String {
        let mut out = String::from("      ");
        for c in 0..self.size {
            out.push_str(&format!(" {:>5}", format!("GPU{c}")));
        }
        out.push('\n');
        for r in 0..self.size {
            out.push_str(&format!("{:<6}", format!("GPU{r}")));
            for c in 0..self.size {
                out.push_str(&format!(
                    " {:>5}",
                    self.links[r * self.size + c].to_string()
                ));
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100_PCIE: &str = "
        GPU0  GPU1  GPU2  GPU3
GPU0     X    NV12  SYS   SYS
GPU1    NV12   X    SYS   SYS
GPU2    SYS   SYS    X    NV12
GPU3    SYS   SYS   NV12   X
";

    #[test]
    fn parses_the_pcie_fixture_block() {
        let m = TopologyMatrix::parse(A100_PCIE).unwrap();
        assert_eq!(m.size(), 4);
        assert_eq!(m.link(GpuIndex(0), GpuIndex(1)), Some(Link::NvLink(12)));
        assert_eq!(m.link(GpuIndex(1), GpuIndex(2)), Some(Link::Sys));
        assert_eq!(m.link(GpuIndex(3), GpuIndex(3)), Some(Link::SelfLink));
        assert_eq!(m.link(GpuIndex(4), GpuIndex(0)), None);
    }

    #[test]
    fn render_round_trips() {
        let m = TopologyMatrix::parse(A100_PCIE).unwrap();
        assert_eq!(TopologyMatrix::parse(&m.render()).unwrap(), m);
    }

    #[test]
    fn every_cell_kind_parses() {
        for (cell, link) in [
            ("X", Link::SelfLink),
            ("NV1", Link::NvLink(1)),
            ("NV18", Link::NvLink(18)),
            ("PIX", Link::Pix),
            ("PXB", Link::Pxb),
            ("PHB", Link::Phb),
            ("NODE", Link::Node),
            ("SYS", Link::Sys),
            ("SOC", Link::Sys),
        ] {
            assert_eq!(Link::parse(cell), Some(link), "{cell}");
        }
        for bad in ["NV", "NV0", "NVx", "nv4", "PCI", ""] {
            assert_eq!(Link::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn scores_order_links_by_closeness() {
        let order = [
            Link::Sys.score(false),
            Link::Node.score(true),
            Link::Phb.score(true),
            Link::Pxb.score(true),
            Link::Pix.score(true),
            Link::NvLink(1).score(false),
            Link::NvLink(1).score(true),
            Link::NvLink(2).score(false),
            Link::SelfLink.score(true),
        ];
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert_eq!(Link::NvLink(12).score(false), 1210);
        assert_eq!(Link::NvLink(18).score(true), 1820);
    }

    #[test]
    fn refuses_malformed_matrices() {
        let cases: [(&str, &str); 8] = [
            ("", "topology_empty"),
            ("GPU0 GPU2\nGPU0 X SYS\nGPU1 SYS X", "topology_bad_header"),
            ("GPU0 GPU1\nGPU0 X SYS", "topology_row_count"),
            (
                "GPU0 GPU1\nGPU0 X SYS\nGPU7 SYS X",
                "topology_bad_row_label",
            ),
            (
                "GPU0 GPU1\nGPU0 X SYS SYS\nGPU1 SYS X",
                "topology_row_width",
            ),
            ("GPU0 GPU1\nGPU0 X LAN\nGPU1 LAN X", "topology_unknown_link"),
            (
                "GPU0 GPU1\nGPU0 SYS SYS\nGPU1 SYS X",
                "topology_diagonal_not_self",
            ),
            ("GPU0 GPU1\nGPU0 X PIX\nGPU1 SYS X", "topology_asymmetric"),
        ];
        for (text, code) in cases {
            assert_eq!(
                TopologyMatrix::parse(text).unwrap_err().code(),
                code,
                "{text}"
            );
        }
        let err = TopologyMatrix::parse("GPU0 GPU1\nGPU0 X X\nGPU1 X X").unwrap_err();
        assert_eq!(err, TopologyError::SelfOffDiagonal { row: 0, column: 1 });
    }

    #[test]
    fn unknown_link_error_names_line_and_cell() {
        let err = TopologyMatrix::parse("\nGPU0 GPU1\nGPU0 X NVL\nGPU1 NVL X").unwrap_err();
        assert_eq!(
            err,
            TopologyError::UnknownLink {
                line: 3,
                column: 1,
                cell: "NVL".into()
            }
        );
    }
}
