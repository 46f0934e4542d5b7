//! Kafka (cargo feature `kafka`): the wire protocol through the pure-Rust `kafka-protocol`
//! crate, over plain TCP (no TLS, no SASL).
//!
//! - Depth: the consumer group's lag on the topic, as KEDA's kafka scaler reads it: the sum
//!   over partitions of (log end offset − committed offset). A partition where the group has no
//!   committed offset counts as KEDA's defaults do (`offsetResetPolicy: latest`,
//!   `scaleToZeroOnInvalidOffset: false`): lag 1, so that one consumer starts and commits.
//!   With `offset_reset: "earliest"`: lag = log end − log start.
//! - Dispatch: a simple consumer (no group membership or rebalancing) assigned every partition
//!   of the topic, shared by all lanes of a pool (one per pool and topic in this process). It
//!   starts at the group's committed offsets (none: the `offset_reset` end, committed at once),
//!   hands out records one at a time, and after each success commits, per partition, the
//!   lowest offset still unfinished (OffsetCommit with generation −1, empty member id) — a
//!   crash redelivers what was in flight, never skips it. Dead letters are produced to the
//!   `dead_letter` topic (default `{topic}.dead`, which must exist). Records compressed with
//!   zstd or lz4 are not decoded (gzip and snappy are).
//!
//! Requests go to the right broker: partition leaders for ListOffsets, Fetch and Produce, the
//! group coordinator (FindCoordinator) for OffsetFetch and OffsetCommit.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::create_topics_request::CreatableTopic;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::offset_commit_request::{
    OffsetCommitRequestPartition, OffsetCommitRequestTopic,
};
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, Request, StrBytes};
use kafka_protocol::records::{
    Compression, Record, RecordBatchDecoder, RecordBatchEncoder, RecordEncodeOptions, TimestampType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::spec::TriggerError;

const IO_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_FRAME: usize = 64 << 20;

fn broker_err(addr: &str, reason: impl std::fmt::Display) -> TriggerError {
    TriggerError::Broker {
        broker: "kafka",
        address: addr.to_string(),
        reason: reason.to_string(),
    }
}

fn code_err(addr: &str, what: &str, code: i16) -> TriggerError {
    match code {
        3 => TriggerError::Missing {
            broker: "kafka",
            what: what.to_string(),
        },
        _ => broker_err(addr, format!("{what}: Kafka error code {code}")),
    }
}

/// One broker connection, with the API versions it supports.
struct Conn {
    addr: String,
    stream: TcpStream,
    versions: HashMap<i16, (i16, i16)>,
    correlation: i32,
}

impl Conn {
    async fn connect(addr: &str) -> Result<Conn, TriggerError> {
        let stream = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| broker_err(addr, "connect timed out"))?
            .map_err(|e| broker_err(addr, e))?;
        let _ = stream.set_nodelay(true);
        let mut c = Conn {
            addr: addr.to_string(),
            stream,
            versions: HashMap::new(),
            correlation: 0,
        };
        let r: ApiVersionsResponse = c.send(&ApiVersionsRequest::default(), 0).await?;
        if r.error_code != 0 {
            return Err(code_err(addr, "ApiVersions", r.error_code));
        }
        c.versions = r
            .api_keys
            .iter()
            .map(|k| (k.api_key, (k.min_version, k.max_version)))
            .collect();
        Ok(c)
    }

    /// The version to speak for `R`: `preferred`, lowered to what the broker supports.
    fn version<R: Request>(&self, preferred: i16) -> Result<i16, TriggerError> {
        let (bmin, bmax) = self.versions.get(&R::KEY).copied().ok_or_else(|| {
            broker_err(
                &self.addr,
                format!("the broker does not offer API {}", R::KEY),
            )
        })?;
        let v = preferred.min(bmax).min(R::VERSIONS.max);
        if v < bmin || v < R::VERSIONS.min {
            return Err(broker_err(
                &self.addr,
                format!("API {}: no common version (broker {bmin}-{bmax})", R::KEY),
            ));
        }
        Ok(v)
    }

    async fn call<R: Request>(
        &mut self,
        req: &R,
        preferred: i16,
    ) -> Result<R::Response, TriggerError> {
        let v = self.version::<R>(preferred)?;
        self.send(req, v).await
    }

    async fn send<R: Request>(&mut self, req: &R, v: i16) -> Result<R::Response, TriggerError> {
        let addr = self.addr.clone();
        let enc = |e: anyhow::Error| broker_err(&addr, format!("encoding: {e}"));
        self.correlation = self.correlation.wrapping_add(1);
        let header = RequestHeader::default()
            .with_request_api_key(R::KEY)
            .with_request_api_version(v)
            .with_correlation_id(self.correlation)
            .with_client_id(Some(StrBytes::from_static_str("torpor")));
        let mut body = BytesMut::new();
        header
            .encode(&mut body, R::header_version(v))
            .map_err(enc)?;
        req.encode(&mut body, v).map_err(enc)?;
        let mut frame = BytesMut::with_capacity(body.len() + 4);
        frame.put_i32(body.len() as i32);
        frame.extend_from_slice(&body);
        let io = async {
            self.stream.write_all(&frame).await?;
            let len = self.stream.read_i32().await? as usize;
            if len > MAX_FRAME {
                return Err(std::io::Error::other(format!("frame of {len} bytes")));
            }
            let mut buf = vec![0u8; len];
            self.stream.read_exact(&mut buf).await?;
            Ok(buf)
        };
        let buf = tokio::time::timeout(IO_TIMEOUT + Duration::from_secs(30), io)
            .await
            .map_err(|_| broker_err(&addr, "no answer"))?
            .map_err(|e| broker_err(&addr, e))?;
        let mut buf = Bytes::from(buf);
        let dec = |e: anyhow::Error| broker_err(&addr, format!("decoding: {e}"));
        let h = ResponseHeader::decode(&mut buf, R::Response::header_version(v)).map_err(dec)?;
        if h.correlation_id != self.correlation {
            return Err(broker_err(&addr, "answer out of order"));
        }
        R::Response::decode(&mut buf, v).map_err(dec)
    }
}

fn topic_name(t: &str) -> TopicName {
    TopicName(StrBytes::from_string(t.to_string()))
}

/// Where to send what, learned from Metadata and FindCoordinator.
struct Client {
    bootstrap: Vec<String>,
    nodes: HashMap<i32, String>,
    conns: HashMap<String, Conn>,
}

/// One partition of the topic and its leader.
#[derive(Debug, Clone, Copy)]
struct Part {
    index: i32,
    leader: i32,
}

impl Client {
    fn new(brokers: &[String]) -> Client {
        Client {
            bootstrap: brokers.to_vec(),
            nodes: HashMap::new(),
            conns: HashMap::new(),
        }
    }

    async fn conn(&mut self, addr: &str) -> Result<&mut Conn, TriggerError> {
        if !self.conns.contains_key(addr) {
            let c = Conn::connect(addr).await?;
            self.conns.insert(addr.to_string(), c);
        }
        Ok(self.conns.get_mut(addr).expect("just inserted"))
    }

    async fn any(&mut self) -> Result<&mut Conn, TriggerError> {
        let mut last = None;
        for b in self.bootstrap.clone() {
            match self.conn(&b).await {
                Ok(_) => return self.conn(&b).await,
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| broker_err("", "no brokers")))
    }

    async fn node(&mut self, id: i32) -> Result<&mut Conn, TriggerError> {
        match self.nodes.get(&id).cloned() {
            Some(addr) => self.conn(&addr).await,
            None => self.any().await,
        }
    }

    /// Forgets every connection (after an error: the next call reconnects).
    fn reset(&mut self) {
        self.conns.clear();
    }

    async fn partitions(&mut self, topic: &str) -> Result<Vec<Part>, TriggerError> {
        let req = MetadataRequest::default()
            .with_topics(Some(vec![
                MetadataRequestTopic::default().with_name(Some(topic_name(topic)))
            ]))
            .with_allow_auto_topic_creation(false);
        let c = self.any().await?;
        let addr = c.addr.clone();
        let r = c.call(&req, 9).await?;
        for b in &r.brokers {
            self.nodes
                .insert(b.node_id.0, format!("{}:{}", b.host, b.port));
        }
        let t = r
            .topics
            .first()
            .ok_or_else(|| broker_err(&addr, "no topic in the metadata answer"))?;
        if t.error_code != 0 {
            return Err(code_err(&addr, &format!("topic {topic}"), t.error_code));
        }
        let mut parts: Vec<Part> = t
            .partitions
            .iter()
            .map(|p| Part {
                index: p.partition_index,
                leader: p.leader_id.0,
            })
            .collect();
        parts.sort_by_key(|p| p.index);
        Ok(parts)
    }

    /// Offsets at `timestamp` (-1: log end, -2: log start) per partition.
    async fn offsets(
        &mut self,
        topic: &str,
        parts: &[Part],
        timestamp: i64,
    ) -> Result<BTreeMap<i32, i64>, TriggerError> {
        let mut by_leader: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
        for p in parts {
            by_leader.entry(p.leader).or_default().push(p.index);
        }
        let mut out = BTreeMap::new();
        for (leader, idx) in by_leader {
            let req = ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(topic_name(topic))
                    .with_partitions(
                        idx.iter()
                            .map(|i| {
                                ListOffsetsPartition::default()
                                    .with_partition_index(*i)
                                    .with_timestamp(timestamp)
                            })
                            .collect(),
                    )]);
            let c = self.node(leader).await?;
            let addr = c.addr.clone();
            let r = c.call(&req, 5).await?;
            for t in r.topics {
                for p in t.partitions {
                    if p.error_code != 0 {
                        return Err(code_err(
                            &addr,
                            &format!("{topic}[{}] offsets", p.partition_index),
                            p.error_code,
                        ));
                    }
                    out.insert(p.partition_index, p.offset);
                }
            }
        }
        Ok(out)
    }

    async fn coordinator(&mut self, group: &str) -> Result<&mut Conn, TriggerError> {
        let req = FindCoordinatorRequest::default()
            .with_key(StrBytes::from_string(group.to_string()))
            .with_key_type(0);
        let c = self.any().await?;
        let addr = c.addr.clone();
        let r = c.call(&req, 3).await?;
        if r.error_code != 0 {
            return Err(code_err(
                &addr,
                &format!("coordinator of group {group}"),
                r.error_code,
            ));
        }
        let a = format!("{}:{}", r.host, r.port);
        self.nodes.insert(r.node_id.0, a.clone());
        self.conn(&a).await
    }

    /// The group's committed offset per partition (-1: none).
    async fn committed(
        &mut self,
        group: &str,
        topic: &str,
        parts: &[Part],
    ) -> Result<BTreeMap<i32, i64>, TriggerError> {
        let req = OffsetFetchRequest::default()
            .with_group_id(GroupId(StrBytes::from_string(group.to_string())))
            .with_topics(Some(vec![OffsetFetchRequestTopic::default()
                .with_name(topic_name(topic))
                .with_partition_indexes(parts.iter().map(|p| p.index).collect())]));
        let c = self.coordinator(group).await?;
        let addr = c.addr.clone();
        let r = c.call(&req, 7).await?;
        if r.error_code != 0 {
            return Err(code_err(&addr, &format!("group {group}"), r.error_code));
        }
        let mut out: BTreeMap<i32, i64> = parts.iter().map(|p| (p.index, -1)).collect();
        for t in r.topics {
            for p in t.partitions {
                if p.error_code != 0 && p.error_code != 3 {
                    return Err(code_err(
                        &addr,
                        &format!("{topic}[{}] committed offset", p.partition_index),
                        p.error_code,
                    ));
                }
                out.insert(p.partition_index, p.committed_offset);
            }
        }
        Ok(out)
    }

    async fn commit(
        &mut self,
        group: &str,
        topic: &str,
        offsets: &BTreeMap<i32, i64>,
    ) -> Result<(), TriggerError> {
        let req = OffsetCommitRequest::default()
            .with_group_id(GroupId(StrBytes::from_string(group.to_string())))
            .with_generation_id_or_member_epoch(-1)
            .with_member_id(StrBytes::from_static_str(""))
            .with_topics(vec![OffsetCommitRequestTopic::default()
                .with_name(topic_name(topic))
                .with_partitions(
                    offsets
                        .iter()
                        .map(|(i, o)| {
                            OffsetCommitRequestPartition::default()
                                .with_partition_index(*i)
                                .with_committed_offset(*o)
                        })
                        .collect(),
                )]);
        let c = self.coordinator(group).await?;
        let addr = c.addr.clone();
        let r = c.call(&req, 7).await?;
        for t in r.topics {
            for p in t.partitions {
                if p.error_code != 0 {
                    return Err(code_err(
                        &addr,
                        &format!("commit {topic}[{}]", p.partition_index),
                        p.error_code,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Records from `positions` on, waiting up to `wait` for the first.
    async fn fetch(
        &mut self,
        topic: &str,
        parts: &[Part],
        positions: &BTreeMap<i32, i64>,
        wait: Duration,
    ) -> Result<Vec<(i32, i64, Vec<u8>)>, TriggerError> {
        let mut by_leader: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
        for p in parts {
            by_leader.entry(p.leader).or_default().push(p.index);
        }
        let mut out = Vec::new();
        let n = by_leader.len().max(1) as u32;
        for (leader, idx) in by_leader {
            let req = FetchRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_max_wait_ms((wait / n).as_millis().max(1) as i32)
                .with_min_bytes(1)
                .with_max_bytes(4 << 20)
                .with_session_epoch(-1)
                .with_topics(vec![FetchTopic::default()
                    .with_topic(topic_name(topic))
                    .with_partitions(
                        idx.iter()
                            .map(|i| {
                                FetchPartition::default()
                                    .with_partition(*i)
                                    .with_fetch_offset(positions.get(i).copied().unwrap_or(0))
                                    .with_partition_max_bytes(1 << 20)
                            })
                            .collect(),
                    )]);
            let c = self.node(leader).await?;
            let addr = c.addr.clone();
            // v11: the last version before flexible encoding. tansu 0.6 answers v12 with a
            // tagged field that version does not define, which kafka-protocol refuses.
            let r = c.call(&req, 11).await?;
            if r.error_code != 0 {
                return Err(code_err(&addr, "fetch", r.error_code));
            }
            for t in r.responses {
                for p in t.partitions {
                    if p.error_code != 0 {
                        return Err(code_err(
                            &addr,
                            &format!("fetch {topic}[{}]", p.partition_index),
                            p.error_code,
                        ));
                    }
                    let from = positions.get(&p.partition_index).copied().unwrap_or(0);
                    let Some(mut records) = p.records else {
                        continue;
                    };
                    while records.has_remaining() {
                        let set = match RecordBatchDecoder::decode(&mut records) {
                            Ok(s) => s,
                            // A batch cut at the end of the answer: fetched again next time.
                            Err(_)
                                if out
                                    .iter()
                                    .any(|r: &(i32, i64, Vec<u8>)| r.0 == p.partition_index) =>
                            {
                                break
                            }
                            Err(e) => return Err(broker_err(&addr, format!("records: {e}"))),
                        };
                        for r in set.records {
                            if r.control || r.offset < from {
                                continue;
                            }
                            out.push((
                                p.partition_index,
                                r.offset,
                                r.value.map(|v| v.to_vec()).unwrap_or_default(),
                            ));
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Appends one record to partition `slot % partitions` of `topic` (acks = all).
    async fn produce(
        &mut self,
        topic: &str,
        value: &[u8],
        slot: usize,
    ) -> Result<(), TriggerError> {
        let parts = self.partitions(topic).await?;
        let part = parts
            .get(slot % parts.len().max(1))
            .copied()
            .ok_or_else(|| broker_err("", format!("topic {topic} has no partitions")))?;
        let record = Record {
            transactional: false,
            control: false,
            delete_horizon: false,
            partition_leader_epoch: -1,
            producer_id: -1,
            producer_epoch: -1,
            timestamp_type: TimestampType::Creation,
            offset: 0,
            sequence: -1,
            timestamp: torpor_now_ms(),
            key: None,
            value: Some(Bytes::copy_from_slice(value)),
            headers: Default::default(),
        };
        let mut buf = BytesMut::new();
        RecordBatchEncoder::encode(
            &mut buf,
            [&record],
            &RecordEncodeOptions {
                version: 2,
                compression: Compression::None,
            },
        )
        .map_err(|e| broker_err("", format!("encoding a record: {e}")))?;
        let req = ProduceRequest::default()
            .with_acks(-1)
            .with_timeout_ms(10_000)
            .with_topic_data(vec![TopicProduceData::default()
                .with_name(topic_name(topic))
                .with_partition_data(vec![PartitionProduceData::default()
                    .with_index(part.index)
                    .with_records(Some(buf.freeze()))])]);
        let c = self.node(part.leader).await?;
        let addr = c.addr.clone();
        let r = c.call(&req, 8).await?;
        for t in r.responses {
            for p in t.partition_responses {
                if p.error_code != 0 {
                    return Err(code_err(
                        &addr,
                        &format!("produce to {topic}"),
                        p.error_code,
                    ));
                }
            }
        }
        Ok(())
    }
}

fn torpor_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Whether a partition without a committed offset starts at the log's end (KEDA's default) or
/// its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reset {
    #[default]
    Latest,
    Earliest,
}

impl Reset {
    pub fn parse(s: Option<&str>) -> Option<Reset> {
        match s {
            None | Some("latest") => Some(Reset::Latest),
            Some("earliest") => Some(Reset::Earliest),
            _ => None,
        }
    }
}

/// Reads the group's lag; keeps its connections between readings.
pub struct LagReader {
    client: Client,
    topic: String,
    group: String,
    reset: Reset,
}

impl LagReader {
    pub fn new(brokers: &[String], topic: &str, group: &str, reset: Reset) -> LagReader {
        LagReader {
            client: Client::new(brokers),
            topic: topic.to_string(),
            group: group.to_string(),
            reset,
        }
    }

    pub async fn lag(&mut self) -> Result<u64, TriggerError> {
        let r = self.lag_inner().await;
        if r.is_err() {
            self.client.reset();
        }
        r
    }

    async fn lag_inner(&mut self) -> Result<u64, TriggerError> {
        let parts = self.client.partitions(&self.topic).await?;
        let end = self.client.offsets(&self.topic, &parts, -1).await?;
        let committed = self
            .client
            .committed(&self.group, &self.topic, &parts)
            .await?;
        let start = if self.reset == Reset::Earliest && committed.values().any(|&o| o < 0) {
            self.client.offsets(&self.topic, &parts, -2).await?
        } else {
            BTreeMap::new()
        };
        Ok(parts
            .iter()
            .map(|p| {
                let end = end.get(&p.index).copied().unwrap_or(0);
                match committed.get(&p.index).copied().unwrap_or(-1) {
                    c if c >= 0 => (end - c).max(0) as u64,
                    _ => match self.reset {
                        Reset::Latest => 1,
                        Reset::Earliest => {
                            (end - start.get(&p.index).copied().unwrap_or(0)).max(0) as u64
                        }
                    },
                }
            })
            .sum())
    }
}

/// A record handed to a lane.
pub struct Taken {
    pub partition: i32,
    pub offset: i64,
    pub value: Vec<u8>,
}

/// The pool-wide simple consumer (see the module documentation).
pub struct GroupConsumer {
    client: Client,
    topic: String,
    group: String,
    reset: Reset,
    parts: Vec<Part>,
    /// Next offset to fetch, per partition.
    positions: BTreeMap<i32, i64>,
    buffer: VecDeque<Taken>,
    in_flight: BTreeMap<i32, BTreeSet<i64>>,
    committed: BTreeMap<i32, i64>,
    ready: bool,
}

type Shared = Arc<tokio::sync::Mutex<GroupConsumer>>;

/// The consumer every lane of one pool shares (by brokers, topic and group).
pub fn shared(brokers: &[String], topic: &str, group: &str, reset: Reset) -> Shared {
    static ALL: OnceLock<std::sync::Mutex<HashMap<String, Shared>>> = OnceLock::new();
    let key = format!("{}|{topic}|{group}", brokers.join(","));
    let mut all = ALL
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    all.entry(key)
        .or_insert_with(|| {
            Arc::new(tokio::sync::Mutex::new(GroupConsumer {
                client: Client::new(brokers),
                topic: topic.to_string(),
                group: group.to_string(),
                reset,
                parts: Vec::new(),
                positions: BTreeMap::new(),
                buffer: VecDeque::new(),
                in_flight: BTreeMap::new(),
                committed: BTreeMap::new(),
                ready: false,
            }))
        })
        .clone()
}

impl GroupConsumer {
    /// Learns the partitions and the starting positions (committing them where the group had
    /// none). Records taken and not settled are handed out again from the committed offsets.
    async fn start(&mut self) -> Result<(), TriggerError> {
        self.parts = self.client.partitions(&self.topic).await?;
        let committed = self
            .client
            .committed(&self.group, &self.topic, &self.parts)
            .await?;
        let missing: Vec<Part> = self
            .parts
            .iter()
            .filter(|p| committed.get(&p.index).copied().unwrap_or(-1) < 0)
            .copied()
            .collect();
        let mut positions = committed.clone();
        if !missing.is_empty() {
            let ts = if self.reset == Reset::Latest { -1 } else { -2 };
            let reset = self.client.offsets(&self.topic, &missing, ts).await?;
            self.client.commit(&self.group, &self.topic, &reset).await?;
            positions.extend(reset);
        }
        self.committed = positions.clone();
        self.positions = positions;
        self.buffer.clear();
        self.in_flight.clear();
        self.ready = true;
        Ok(())
    }

    pub async fn next(&mut self, wait: Duration) -> Result<Option<Taken>, TriggerError> {
        let r = self.next_inner(wait).await;
        if r.is_err() {
            self.client.reset();
            self.ready = false;
        }
        r
    }

    async fn next_inner(&mut self, wait: Duration) -> Result<Option<Taken>, TriggerError> {
        if !self.ready {
            self.start().await?;
        }
        if self.buffer.is_empty() {
            let got = self
                .client
                .fetch(&self.topic, &self.parts, &self.positions, wait)
                .await?;
            for (partition, offset, value) in got {
                self.positions.insert(partition, offset + 1);
                self.buffer.push_back(Taken {
                    partition,
                    offset,
                    value,
                });
            }
        }
        let Some(t) = self.buffer.pop_front() else {
            return Ok(None);
        };
        self.in_flight
            .entry(t.partition)
            .or_default()
            .insert(t.offset);
        Ok(Some(Taken {
            partition: t.partition,
            offset: t.offset,
            value: t.value.clone(),
        }))
    }

    /// The record is done (processed or dead-lettered): commit, per partition, the lowest
    /// offset not yet done.
    pub async fn settle(&mut self, partition: i32, offset: i64) -> Result<(), TriggerError> {
        if let Some(s) = self.in_flight.get_mut(&partition) {
            s.remove(&offset);
        }
        let low = commit_point(
            self.in_flight.get(&partition),
            self.buffer
                .iter()
                .filter(|t| t.partition == partition)
                .map(|t| t.offset),
            self.positions.get(&partition).copied().unwrap_or(0),
        );
        if low > self.committed.get(&partition).copied().unwrap_or(-1) {
            let r = self
                .client
                .commit(
                    &self.group,
                    &self.topic,
                    &BTreeMap::from([(partition, low)]),
                )
                .await;
            if r.is_err() {
                self.client.reset();
                return r;
            }
            self.committed.insert(partition, low);
        }
        Ok(())
    }

    pub async fn produce(&mut self, topic: &str, value: &[u8]) -> Result<(), TriggerError> {
        let r = self.client.produce(topic, value, 0).await;
        if r.is_err() {
            self.client.reset();
        }
        r
    }
}

/// The offset to commit for a partition: the lowest one still handed out and unsettled, or
/// fetched and not yet handed out; with neither, the next offset to fetch.
fn commit_point(
    in_flight: Option<&BTreeSet<i64>>,
    buffered: impl Iterator<Item = i64>,
    next_fetch: i64,
) -> i64 {
    in_flight
        .and_then(|s| s.first().copied())
        .into_iter()
        .chain(buffered)
        .min()
        .unwrap_or(next_fetch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_never_pass_an_unsettled_record() {
        // Lanes took 5, 6 and 7; 6 and 7 finished first: the commit stays at 5.
        let inflight = BTreeSet::from([5]);
        assert_eq!(commit_point(Some(&inflight), [].into_iter(), 8), 5);
        // All settled, 8 and 9 fetched but not handed out: commit 8.
        assert_eq!(commit_point(None, [8, 9].into_iter(), 10), 8);
        assert_eq!(
            commit_point(Some(&BTreeSet::new()), [9, 8].into_iter(), 10),
            8
        );
        // Nothing in flight or buffered: everything up to the next fetch is done.
        assert_eq!(commit_point(None, [].into_iter(), 10), 10);
    }

    #[test]
    fn reset_policy_parses() {
        assert_eq!(Reset::parse(None), Some(Reset::Latest));
        assert_eq!(Reset::parse(Some("earliest")), Some(Reset::Earliest));
        assert_eq!(Reset::parse(Some("middle")), None);
    }
}

/// Test and tooling helpers: create a topic, produce records.
pub mod admin {
    use super::*;

    pub async fn create_topic(
        brokers: &[String],
        topic: &str,
        partitions: i32,
    ) -> Result<(), TriggerError> {
        let mut c = Client::new(brokers);
        let req = CreateTopicsRequest::default()
            .with_timeout_ms(10_000)
            .with_topics(vec![CreatableTopic::default()
                .with_name(topic_name(topic))
                .with_num_partitions(partitions)
                .with_replication_factor(1)]);
        let conn = c.any().await?;
        let addr = conn.addr.clone();
        let r = conn.call(&req, 5).await?;
        for t in r.topics {
            // 36: already exists.
            if t.error_code != 0 && t.error_code != 36 {
                return Err(code_err(&addr, &format!("create {topic}"), t.error_code));
            }
        }
        Ok(())
    }

    /// Produces each value to partition `i % partitions`.
    pub async fn produce(
        brokers: &[String],
        topic: &str,
        values: &[Vec<u8>],
    ) -> Result<(), TriggerError> {
        let mut c = Client::new(brokers);
        for (i, v) in values.iter().enumerate() {
            c.produce(topic, v, i).await?;
        }
        Ok(())
    }
}
