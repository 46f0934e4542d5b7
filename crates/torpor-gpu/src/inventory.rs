//! The inventory of one node: its GPUs and their topology.
//!
//! An inventory comes from NVML when a driver is present (feature `nvml`) or from a declared
//! TOML file. This module owns the declared format, its strict parsing and the checks every
//! inventory passes whatever its source; it never talks to a driver.
//!
//! The declared format (see the crate README for the full reference):
//!
//! ```toml
//! node = "hgx-h200-01"
//!
//! [[gpu]]
//! index = 0
//! uuid = "GPU-…"
//! model = "NVIDIA H200"
//! memory_mib = 143771
//! mig_capable = true
//! numa_node = 0
//! pci_bus_id = "0000:19:00.0"
//! # optional: mode = "whole" | "mig" | "mps" | "timeslice"   (initial mode, default whole)
//! # optional: mig_geometry = "H200-141GB"  (when the model name is not recognised)
//! # optional: mps_max_clients = 48, timeslice_replicas = 4, minor = <index>
//!
//! topology = """
//!         GPU0  GPU1
//! GPU0     X    NV18
//! GPU1    NV18   X
//! """
//! ```
//!
//! A key written after the last `[[gpu]]` table belongs to that table in TOML, which is where
//! the fixtures' `topology` lands; so `topology` is accepted at the top level or in exactly one
//! `[[gpu]]` table, and always describes the whole node.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use crate::ids::{GpuIndex, GpuUuid, IdError, NodeName};
use crate::mig::{MigGeometry, MigModel};
use crate::partition::PartitionMode;
use crate::topology::{Link, TopologyError, TopologyMatrix, SCORE_SAME_GPU};

/// MPS clients per GPU when the inventory does not say (the limit of Volta and later).
pub const DEFAULT_MPS_MAX_CLIENTS: u32 = 48;
/// Time-slice replicas per GPU when the inventory does not say.
pub const DEFAULT_TIMESLICE_REPLICAS: u32 = 4;
/// Largest inventory file read, to bound memory on a bad path.
pub const MAX_INVENTORY_BYTES: u64 = 4 * 1024 * 1024;

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: GpuIndex,
    pub uuid: GpuUuid,
    /// Product name as NVML reports it, e.g. `NVIDIA H200`.
    pub model: String,
    pub memory_mib: u64,
    pub mig_capable: bool,
    /// The table model; `None` when the GPU has no MIG or the table does not know the model.
    pub mig_model: Option<MigModel>,
    /// MIG geometry used for placement: the table's for `mig_model`, or the driver's.
    pub mig_geometry: Option<Arc<MigGeometry>>,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
    /// The mode the GPU is in when the node starts.
    pub initial_mode: PartitionMode,
    pub mps_max_clients: u32,
    pub timeslice_replicas: u32,
}

impl Gpu {
    /// Whether MIG can be used: capable and with known geometry.
    pub fn mig_ready(&self) -> bool {
        self.mig_capable && self.mig_geometry.is_some()
    }
}

/// The GPUs of one node and the links between them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    pub node: NodeName,
    gpus: Vec<Gpu>,
    topology: TopologyMatrix,
}

/// Why an inventory was refused. `file` is the path or a label such as `nvml`; `field` is a
/// path into the document such as `gpu[3].uuid`.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("{file}: cannot read")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: larger than {max} bytes")]
    TooLarge { file: String, max: u64 },
    #[error("{file}:{line}:{column}: {field}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        field: String,
        message: String,
    },
    #[error("{file}: the inventory has no [[gpu]]")]
    NoGpus { file: String },
    #[error("{file}: {field}: {source}")]
    BadId {
        file: String,
        field: String,
        #[source]
        source: IdError,
    },
    #[error("{file}: {field}: index {index} appears twice")]
    DuplicateIndex {
        file: String,
        field: String,
        index: u32,
    },
    #[error(
        "{file}: {field}: index {index} is out of range for {count} GPUs (indices are 0..{count})"
    )]
    IndexOutOfRange {
        file: String,
        field: String,
        index: u32,
        count: usize,
    },
    #[error("{file}: {field}: UUID {uuid} appears twice")]
    DuplicateUuid {
        file: String,
        field: String,
        uuid: GpuUuid,
    },
    #[error("{file}: {field}: must be greater than zero")]
    Zero { file: String, field: String },
    #[error("{file}: {field}: {value:?} is not a MIG geometry; known are A100-40GB, A100-80GB, H100-80GB, H200-141GB")]
    UnknownMigGeometry {
        file: String,
        field: String,
        value: String,
    },
    #[error("{file}: {field}: mode mig needs mig_capable = true and a known MIG geometry")]
    MigModeUnavailable { file: String, field: String },
    #[error("{file}: the node has {gpus} GPUs but no topology matrix")]
    TopologyMissing { file: String, gpus: usize },
    #[error("{file}: topology is given twice ({first} and {second})")]
    TopologyTwice {
        file: String,
        first: String,
        second: String,
    },
    #[error("{file}:{line}: {field}: {source}")]
    Topology {
        file: String,
        field: String,
        /// Line in the file where the topology block starts (1 when unknown).
        line: usize,
        #[source]
        source: TopologyError,
    },
    #[error("{file}: {field}: the topology matrix has {matrix} GPUs but the inventory has {gpus}")]
    TopologySize {
        file: String,
        field: String,
        matrix: usize,
        gpus: usize,
    },
}

impl InventoryError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            InventoryError::Read { .. } => "inventory_read",
            InventoryError::TooLarge { .. } => "inventory_too_large",
            InventoryError::Parse { .. } => "inventory_parse",
            InventoryError::NoGpus { .. } => "inventory_no_gpus",
            InventoryError::BadId { .. } => "inventory_bad_id",
            InventoryError::DuplicateIndex { .. } => "inventory_duplicate_index",
            InventoryError::IndexOutOfRange { .. } => "inventory_index_out_of_range",
            InventoryError::DuplicateUuid { .. } => "inventory_duplicate_uuid",
            InventoryError::Zero { .. } => "inventory_zero",
            InventoryError::UnknownMigGeometry { .. } => "inventory_unknown_mig_geometry",
            InventoryError::MigModeUnavailable { .. } => "inventory_mig_mode_unavailable",
            InventoryError::TopologyMissing { .. } => "inventory_topology_missing",
            InventoryError::TopologyTwice { .. } => "inventory_topology_twice",
            InventoryError::Topology { .. } => "inventory_topology",
            InventoryError::TopologySize { .. } => "inventory_topology_size",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeclaredInventory {
    node: String,
    #[serde(default)]
    gpu: Vec<DeclaredGpu>,
    topology: Option<toml::Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeclaredGpu {
    index: u32,
    uuid: String,
    model: String,
    memory_mib: u64,
    mig_capable: bool,
    numa_node: Option<u32>,
    pci_bus_id: String,
    mode: Option<PartitionMode>,
    mig_geometry: Option<String>,
    mps_max_clients: Option<u32>,
    timeslice_replicas: Option<u32>,
    minor: Option<u32>,
    topology: Option<toml::Spanned<String>>,
}

/// 1-based line and column of a byte offset.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text.as_bytes()[..offset];
    let line = before.iter().filter(|b| **b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, column)
}

/// The field path (`gpu[2]` or the top level) that contains a byte offset.
fn table_at(text: &str, offset: usize) -> String {
    let gpus = text
        .as_bytes()
        .get(..offset.min(text.len()))
        .map(String::from_utf8_lossy)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.trim() == "[[gpu]]")
        .count();
    match gpus {
        0 => "(top level)".to_owned(),
        n => format!("gpu[{}]", n - 1),
    }
}

/// The file line of the first matrix line of a spanned topology string.
fn topology_first_line(text: &str, span: std::ops::Range<usize>) -> usize {
    let (line, _) = line_column(text, span.start);
    let literal = text.get(span).unwrap_or_default();
    let body = literal
        .strip_prefix("\"\"\"")
        .or_else(|| literal.strip_prefix("'''"));
    if body.is_some_and(|b| b.starts_with(['\n', '\r'])) {
        line + 1
    } else {
        line
    }
}

impl Inventory {
    /// Builds an inventory and checks it: indices are exactly `0..n`, UUIDs unique, memory
    /// non-zero, the matrix matches the GPU count. GPUs are kept sorted by index. A GPU may be
    /// in MIG mode without known geometry (NVML reports what the hardware is in); it then takes
    /// no MIG share until it is empty and switched to another mode.
    pub fn new(
        node: NodeName,
        mut gpus: Vec<Gpu>,
        topology: Option<TopologyMatrix>,
        file: &str,
    ) -> Result<Self, InventoryError> {
        let file = file.to_owned();
        if gpus.is_empty() {
            return Err(InventoryError::NoGpus { file });
        }
        let count = gpus.len();
        let mut indices = BTreeSet::new();
        let mut uuids = BTreeSet::new();
        for (i, gpu) in gpus.iter().enumerate() {
            let field = |name: &str| format!("gpu[{i}].{name}");
            if gpu.index.0 as usize >= count {
                return Err(InventoryError::IndexOutOfRange {
                    file,
                    field: field("index"),
                    index: gpu.index.0,
                    count,
                });
            }
            if !indices.insert(gpu.index) {
                return Err(InventoryError::DuplicateIndex {
                    file,
                    field: field("index"),
                    index: gpu.index.0,
                });
            }
            if !uuids.insert(gpu.uuid.clone()) {
                return Err(InventoryError::DuplicateUuid {
                    file,
                    field: field("uuid"),
                    uuid: gpu.uuid.clone(),
                });
            }
            for (name, value) in [
                ("memory_mib", gpu.memory_mib),
                ("mps_max_clients", u64::from(gpu.mps_max_clients)),
                ("timeslice_replicas", u64::from(gpu.timeslice_replicas)),
            ] {
                if value == 0 {
                    return Err(InventoryError::Zero {
                        file,
                        field: field(name),
                    });
                }
            }
        }
        gpus.sort_by_key(|g| g.index);
        let topology = match topology {
            Some(matrix) if matrix.size() != count => {
                return Err(InventoryError::TopologySize {
                    file,
                    field: "topology".to_owned(),
                    matrix: matrix.size(),
                    gpus: count,
                })
            }
            Some(matrix) => matrix,
            None if count == 1 => TopologyMatrix::single(),
            None => return Err(InventoryError::TopologyMissing { file, gpus: count }),
        };
        Ok(Inventory {
            node,
            gpus,
            topology,
        })
    }

    /// Reads a declared inventory file.
    pub fn load(path: &Path) -> Result<Self, InventoryError> {
        use std::io::Read;
        let file = path.display().to_string();
        let handle = std::fs::File::open(path).map_err(|source| InventoryError::Read {
            file: file.clone(),
            source,
        })?;
        let mut text = String::new();
        handle
            .take(MAX_INVENTORY_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|source| InventoryError::Read {
                file: file.clone(),
                source,
            })?;
        if text.len() as u64 > MAX_INVENTORY_BYTES {
            return Err(InventoryError::TooLarge {
                file,
                max: MAX_INVENTORY_BYTES,
            });
        }
        Self::from_toml(&text, &file)
    }

    /// Parses a declared inventory; `file` names the source in errors.
    pub fn from_toml(text: &str, file: &str) -> Result<Self, InventoryError> {
        let declared: DeclaredInventory = toml::from_str(text).map_err(|e: toml::de::Error| {
            let offset = e.span().map_or(0, |s| s.start);
            let (line, column) = line_column(text, offset);
            InventoryError::Parse {
                file: file.to_owned(),
                line,
                column,
                field: table_at(text, offset),
                message: e.message().trim().to_owned(),
            }
        })?;
        let bad_id = |field: String| {
            let file = file.to_owned();
            move |source| InventoryError::BadId {
                file,
                field,
                source,
            }
        };
        let node = NodeName::new(declared.node).map_err(bad_id("node".to_owned()))?;

        let mut topology_source: Option<(String, toml::Spanned<String>)> =
            declared.topology.map(|t| ("topology".to_owned(), t));
        let mut gpus = Vec::with_capacity(declared.gpu.len());
        for (i, g) in declared.gpu.into_iter().enumerate() {
            let field = |name: &str| format!("gpu[{i}].{name}");
            if let Some(t) = g.topology {
                if let Some((first, _)) = &topology_source {
                    return Err(InventoryError::TopologyTwice {
                        file: file.to_owned(),
                        first: first.clone(),
                        second: field("topology"),
                    });
                }
                topology_source = Some((field("topology"), t));
            }
            let uuid = GpuUuid::new(g.uuid).map_err(bad_id(field("uuid")))?;
            let mig_model = match (&g.mig_geometry, g.mig_capable) {
                (Some(label), _) => Some(MigModel::from_label(label).ok_or_else(|| {
                    InventoryError::UnknownMigGeometry {
                        file: file.to_owned(),
                        field: field("mig_geometry"),
                        value: label.clone(),
                    }
                })?),
                (None, true) => MigModel::detect(&g.model, g.memory_mib),
                (None, false) => None,
            };
            if g.mode == Some(PartitionMode::Mig) && !(g.mig_capable && mig_model.is_some()) {
                return Err(InventoryError::MigModeUnavailable {
                    file: file.to_owned(),
                    field: field("mode"),
                });
            }
            gpus.push(Gpu {
                index: GpuIndex(g.index),
                uuid,
                model: g.model,
                memory_mib: g.memory_mib,
                mig_capable: g.mig_capable,
                mig_model: if g.mig_capable { mig_model } else { None },
                mig_geometry: if g.mig_capable {
                    mig_model.map(MigModel::geometry)
                } else {
                    None
                },
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id,
                minor: g.minor.unwrap_or(g.index),
                initial_mode: g.mode.unwrap_or(PartitionMode::Whole),
                mps_max_clients: g.mps_max_clients.unwrap_or(DEFAULT_MPS_MAX_CLIENTS),
                timeslice_replicas: g.timeslice_replicas.unwrap_or(DEFAULT_TIMESLICE_REPLICAS),
            });
        }
        let topology = match topology_source {
            None => None,
            Some((field, spanned)) => {
                let line = topology_first_line(text, spanned.span());
                let matrix = TopologyMatrix::parse(spanned.get_ref()).map_err(|source| {
                    let line = match &source {
                        TopologyError::BadHeader { line: l, .. }
                        | TopologyError::BadRowLabel { line: l, .. }
                        | TopologyError::RowWidth { line: l, .. }
                        | TopologyError::UnknownLink { line: l, .. } => line + l - 1,
                        _ => line,
                    };
                    InventoryError::Topology {
                        file: file.to_owned(),
                        field: field.clone(),
                        line,
                        source,
                    }
                })?;
                if matrix.size() != gpus.len() {
                    return Err(InventoryError::TopologySize {
                        file: file.to_owned(),
                        field,
                        matrix: matrix.size(),
                        gpus: gpus.len(),
                    });
                }
                Some(matrix)
            }
        };
        Self::new(node, gpus, topology, file)
    }

    /// GPUs sorted by index; `gpus()[i].index == GpuIndex(i)`.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    pub fn gpu(&self, index: GpuIndex) -> Option<&Gpu> {
        self.gpus.get(index.0 as usize)
    }

    pub fn gpu_by_uuid(&self, uuid: &GpuUuid) -> Option<&Gpu> {
        self.gpus.iter().find(|g| &g.uuid == uuid)
    }

    pub fn topology(&self) -> &TopologyMatrix {
        &self.topology
    }

    /// Link between two GPUs of this node (`None` for an index outside the node).
    pub fn link(&self, a: GpuIndex, b: GpuIndex) -> Option<Link> {
        self.topology.link(a, b)
    }

    /// Pair score of two GPUs (higher is closer); the same GPU scores highest.
    pub fn pair_score(&self, a: GpuIndex, b: GpuIndex) -> u32 {
        if a == b {
            return SCORE_SAME_GPU;
        }
        let same_numa = match (self.gpu(a), self.gpu(b)) {
            (Some(x), Some(y)) => x.numa_node.is_some() && x.numa_node == y.numa_node,
            _ => false,
        };
        self.link(a, b).map_or(0, |l| l.score(same_numa))
    }

    /// Sum of pair scores over every unordered pair of `gpus` (repeats count as same GPU).
    pub fn set_score(&self, gpus: &[GpuIndex]) -> u64 {
        let mut total = 0u64;
        for (i, a) in gpus.iter().enumerate() {
            for b in &gpus[i + 1..] {
                total += u64::from(self.pair_score(*a, *b));
            }
        }
        total
    }

    /// Whether two distinct GPUs are joined by NVLink (a GPU is in its own domain).
    pub fn nvlinked(&self, a: GpuIndex, b: GpuIndex) -> bool {
        a == b || self.link(a, b).is_some_and(Link::is_nvlink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"
node = "n1"

[[gpu]]
index = 0
uuid = "GPU-0"
model = "NVIDIA L4"
memory_mib = 23034
mig_capable = false
numa_node = 0
pci_bus_id = "0000:01:00.0"

[[gpu]]
index = 1
uuid = "GPU-1"
model = "NVIDIA L4"
memory_mib = 23034
mig_capable = false
numa_node = 0
pci_bus_id = "0000:02:00.0"

topology = """
        GPU0  GPU1
GPU0     X    PHB
GPU1    PHB    X
"""
"#;

    fn parse(text: &str) -> Result<Inventory, InventoryError> {
        Inventory::from_toml(text, "test.toml")
    }

    #[test]
    fn parses_topology_written_after_the_last_gpu() {
        let inv = parse(TWO).unwrap();
        assert_eq!(inv.gpus().len(), 2);
        assert_eq!(inv.link(GpuIndex(0), GpuIndex(1)), Some(Link::Phb));
        assert_eq!(inv.gpu(GpuIndex(1)).unwrap().minor, 1);
        assert_eq!(
            inv.gpu(GpuIndex(0)).unwrap().mps_max_clients,
            DEFAULT_MPS_MAX_CLIENTS
        );
    }

    #[test]
    fn topology_at_top_level_is_accepted() {
        let text = TWO.replace("node = \"n1\"\n", "");
        let (gpus, topo) = text.split_at(text.find("topology =").unwrap());
        let text = format!("node = \"n1\"\n{topo}\n{gpus}");
        let inv = parse(&text).unwrap();
        assert_eq!(inv.topology().size(), 2);
    }

    #[test]
    fn unknown_field_names_file_line_column_and_table() {
        let text = TWO.replace(
            "numa_node = 0\npci_bus_id = \"0000:02",
            "numa = 0\npci_bus_id = \"0000:02",
        );
        let err = parse(&text).unwrap_err();
        let InventoryError::Parse {
            file,
            line,
            column,
            field,
            message,
        } = &err
        else {
            panic!("unexpected {err:?}");
        };
        assert_eq!((file.as_str(), *line, *column), ("test.toml", 19, 1));
        assert_eq!(field, "gpu[1]");
        assert!(message.contains("unknown field `numa`"), "{message}");
        assert!(err.to_string().starts_with("test.toml:19:1: gpu[1]: "));
    }

    #[test]
    fn syntax_errors_give_line_and_column() {
        let err = parse("node = \"n1\"\n[[gpu]]\nindex = = 3\n").unwrap_err();
        assert_eq!(err.code(), "inventory_parse");
        let InventoryError::Parse { line, column, .. } = err else {
            unreachable!()
        };
        assert_eq!((line, column), (3, 9));
    }

    #[test]
    fn topology_errors_point_at_the_file_line() {
        let text = TWO.replace("GPU1    PHB    X", "GPU1    PHX    X");
        let err = parse(&text).unwrap_err();
        assert_eq!(err.code(), "inventory_topology");
        let InventoryError::Topology { line, field, .. } = &err else {
            unreachable!()
        };
        assert_eq!(field, "gpu[1].topology");
        assert_eq!(*line, 25);
        assert_eq!(text.lines().nth(24).unwrap().trim(), "GPU1    PHX    X");
    }

    #[test]
    fn refuses_semantic_errors() {
        let cases = [
            (TWO.replace("index = 1", "index = 0"), "inventory_duplicate_index"),
            (TWO.replace("index = 1", "index = 5"), "inventory_index_out_of_range"),
            (TWO.replace("GPU-1", "GPU-0"), "inventory_duplicate_uuid"),
            (TWO.replace("\"GPU-1\"", "\"gpu1\""), "inventory_bad_id"),
            (TWO.replace("memory_mib = 23034\nmig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:02", "memory_mib = 0\nmig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:02"), "inventory_zero"),
            (TWO.replace("mig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:01", "mig_capable = false\nmode = \"mig\"\nnuma_node = 0\npci_bus_id = \"0000:01"), "inventory_mig_mode_unavailable"),
            (TWO.replace("mig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:01", "mig_capable = true\nmig_geometry = \"B200\"\nnuma_node = 0\npci_bus_id = \"0000:01"), "inventory_unknown_mig_geometry"),
            (TWO[..TWO.find("topology").unwrap()].to_owned(), "inventory_topology_missing"),
            ("node = \"n1\"\n".to_owned(), "inventory_no_gpus"),
            (TWO.replace("node = \"n1\"", "node = \"n1\"\ntopology = \"GPU0\\nGPU0 X\""), "inventory_topology_twice"),
            (TWO.replace("node = \"n1\"", "node = \"n 1\""), "inventory_bad_id"),
            (TWO.replace("index = 1", "index = -1"), "inventory_parse"),
            (TWO.replace("mode", "x").replace("mig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:01", "mig_capable = false\nmode = \"shared\"\nnuma_node = 0\npci_bus_id = \"0000:01"), "inventory_parse"),
        ];
        for (text, code) in cases {
            assert_eq!(parse(&text).unwrap_err().code(), code, "{text}");
        }
    }

    #[test]
    fn topology_must_match_gpu_count() {
        let text = TWO.replace(
            "        GPU0  GPU1\nGPU0     X    PHB\nGPU1    PHB    X\n",
            "GPU0\nGPU0 X\n",
        );
        let err = parse(&text).unwrap_err();
        assert!(matches!(
            err,
            InventoryError::TopologySize {
                matrix: 1,
                gpus: 2,
                ..
            }
        ));
    }

    #[test]
    fn one_gpu_needs_no_topology() {
        let end = TWO.find("[[gpu]]\nindex = 1").unwrap();
        let inv = parse(&TWO[..end]).unwrap();
        assert_eq!(inv.topology().size(), 1);
    }

    #[test]
    fn extended_fields_are_read() {
        let text = TWO.replace(
            "mig_capable = false\nnuma_node = 0\npci_bus_id = \"0000:01",
            "mig_capable = true\nmig_geometry = \"A100-40GB\"\nmode = \"mig\"\nmps_max_clients = 16\ntimeslice_replicas = 8\nminor = 9\nnuma_node = 0\npci_bus_id = \"0000:01",
        );
        let inv = parse(&text).unwrap();
        let g = inv.gpu(GpuIndex(0)).unwrap();
        assert_eq!(g.mig_model, Some(MigModel::A100Gb40));
        assert_eq!(g.initial_mode, PartitionMode::Mig);
        assert_eq!(
            (g.mps_max_clients, g.timeslice_replicas, g.minor),
            (16, 8, 9)
        );
    }

    #[test]
    fn load_reports_missing_files() {
        let err = Inventory::load(Path::new("/nonexistent/inv.toml")).unwrap_err();
        assert_eq!(err.code(), "inventory_read");
        assert!(err.to_string().contains("/nonexistent/inv.toml"));
    }
}
