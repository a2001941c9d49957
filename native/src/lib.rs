//! rollout-log's compiled replay reader.
//!
//! Replay spent most of its time in Python, once per message: aiokafka building a ConsumerRecord, the frame
//! decode, the Arrow build. Here a fetched Kafka record set (v2 record batches, as the broker sent them) is
//! read in one call: batch CRCs, read_committed filtering (aborted transactions, control batches), the run
//! filter, and every Step frame decoded straight into Arrow column buffers.
//!
//! The decoder accepts a strict subset of what `schemas.events.Step` accepts and stores the same values the
//! Python path stores (`replay.frames` + `replay.columns.steps`). Everything else is handed back to Python as a
//! "leftover" record (other event types, older schema versions, any frame this code does not recognise or
//! would refuse), so refusals and their messages stay those of the models. `tests/test_replay_native.py`
//! holds the two paths to the same rows.

use std::borrow::Cow;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use serde::{Deserialize, Serialize};

// ------------------------------------------------------------------------------------------ columns

#[derive(Default)]
struct Validity {
    bits: Vec<u8>,
    nulls: usize,
}

impl Validity {
    fn push(&mut self, len: usize, valid: bool) {
        if len % 8 == 0 {
            self.bits.push(0);
        }
        if valid {
            self.bits[len / 8] |= 1 << (len % 8);
        } else {
            self.nulls += 1;
        }
    }
}

#[derive(Default)]
struct StrCol {
    offsets: Vec<i32>,
    data: Vec<u8>,
    valid: Validity,
}

impl StrCol {
    fn push(&mut self, v: Option<&str>) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        let len = self.offsets.len() - 1;
        self.valid.push(len, v.is_some());
        if let Some(s) = v {
            self.data.extend_from_slice(s.as_bytes());
        }
        self.offsets.push(self.data.len() as i32);
    }
}

#[derive(Default)]
struct NumCol<T> {
    values: Vec<T>,
    valid: Validity,
}

impl<T: Copy + Default> NumCol<T> {
    fn push(&mut self, v: Option<T>) {
        let len = self.values.len();
        self.valid.push(len, v.is_some());
        self.values.push(v.unwrap_or_default());
    }
}

#[derive(Default)]
struct BoolCol {
    values: Validity, // the values' bits, packed as Arrow packs booleans
    len: usize,
}

impl BoolCol {
    fn push(&mut self, v: bool) {
        self.values.push(self.len, v);
        self.len += 1;
    }
}

/// A LIST<number> column: offsets and the values' little-endian bytes, copied from the frames' blobs.
#[derive(Default)]
struct ListCol {
    offsets: Vec<i32>,
    data: Vec<u8>,
    itemsize: usize,
}

impl ListCol {
    fn new(itemsize: usize) -> Self {
        ListCol { offsets: vec![0], data: Vec::new(), itemsize }
    }
    fn push(&mut self, bytes: &[u8]) {
        self.data.extend_from_slice(bytes);
        self.offsets.push((self.data.len() / self.itemsize) as i32);
    }
}

fn as_bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers (i32, i64, f64) with no padding, viewed as bytes in native (little-endian) order.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The `steps` table of one flush, column by column (names and types: `replay.tables.STEPS`).
#[pyclass(module = "rollout_native")]
struct StepColumns {
    rows: usize,
    #[pyo3(get)]
    nbytes: usize, // frame bytes of the rows' messages
    strs: Vec<(&'static str, StrCol)>,
    created_at: NumCol<i64>,
    schema_version: NumCol<i32>,
    step_index: NumCol<i32>,
    trainable: BoolCol,
    policy_exact: BoolCol,
    policy_revision: NumCol<i64>,
    n_prompt_tokens: NumCol<i32>,
    n_completion_tokens: NumCol<i32>,
    latency_s: NumCol<f64>,
    partition: NumCol<i32>,
    offset: NumCol<i64>,
    ts: NumCol<i64>,
    prompt_token_ids: ListCol,
    completion_token_ids: ListCol,
    completion_logprobs: ListCol,
}

// string columns, in the order StepColumns.strs holds them
const STR_COLUMNS: [&str; 16] = [
    "event_id", "run_id", "producer", "causation_id", "step_id", "rollout_id", "root_group_id", "member_id",
    "target", "policy_family", "policy_checkpoint_digest", "prompt", "completion", "tool_calls",
    "finish_reason", "_topic",
];

impl StepColumns {
    fn fresh() -> Self {
        StepColumns {
            rows: 0,
            nbytes: 0,
            strs: STR_COLUMNS.iter().map(|n| (*n, StrCol::default())).collect(),
            created_at: NumCol::default(),
            schema_version: NumCol::default(),
            step_index: NumCol::default(),
            trainable: BoolCol::default(),
            policy_exact: BoolCol::default(),
            policy_revision: NumCol::default(),
            n_prompt_tokens: NumCol::default(),
            n_completion_tokens: NumCol::default(),
            latency_s: NumCol::default(),
            partition: NumCol::default(),
            offset: NumCol::default(),
            ts: NumCol::default(),
            prompt_token_ids: ListCol::new(4),
            completion_token_ids: ListCol::new(4),
            completion_logprobs: ListCol::new(4),
        }
    }

    fn push(&mut self, s: &Decoded, topic: &str, partition: i32, offset: i64, ts: i64) {
        let h = &s.header;
        let policy = h.policy.as_ref();
        let texts: [Option<&str>; 16] = [
            Some(&h.event_id), Some(&h.run_id), Some(&h.producer), h.causation_id.as_deref(), Some(&h.step_id),
            Some(&h.rollout_id), Some(&h.root_group_id), Some(&h.member_id), Some(&h.target),
            policy.map(|p| p.family.as_ref()), policy.and_then(|p| p.checkpoint_digest.as_deref()),
            Some(&s.prompt), Some(&s.completion), Some(&s.tool_calls), Some(&h.finish_reason), Some(topic),
        ];
        for ((_, col), v) in self.strs.iter_mut().zip(texts) {
            col.push(v);
        }
        self.created_at.push(Some(s.created_at_us));
        self.schema_version.push(Some(h.schema_version as i32));
        self.step_index.push(Some(h.index as i32));
        self.trainable.push(h.trainable);
        self.policy_exact.push(h.policy_exact);
        self.policy_revision.push(policy.map(|p| p.revision));
        self.n_prompt_tokens.push(Some((s.prompt_ids.len() / 4) as i32));
        self.n_completion_tokens.push(Some((s.completion_ids.len() / 4) as i32));
        self.latency_s.push(Some(h.latency_s));
        self.partition.push(Some(partition));
        self.offset.push(Some(offset));
        self.ts.push(Some(ts));
        self.prompt_token_ids.push(s.prompt_ids);
        self.completion_token_ids.push(s.completion_ids);
        self.completion_logprobs.push(s.logprobs);
        self.rows += 1;
    }
}

fn validity<'py>(py: Python<'py>, v: &Validity) -> Bound<'py, PyAny> {
    if v.nulls == 0 { py.None().into_bound(py) } else { PyBytes::new(py, &v.bits).into_any() }
}

#[pymethods]
impl StepColumns {
    #[new]
    fn new() -> Self {
        StepColumns::fresh()
    }

    fn __len__(&self) -> usize {
        self.rows
    }

    /// Every column as (validity or None, null count, buffers...), by name; the columns start empty again.
    /// Strings: (validity, nulls, offsets, data); numbers, booleans, timestamps: (validity, nulls, values);
    /// lists: (None, 0, offsets, values).
    fn take<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = std::mem::replace(self, StepColumns::fresh());
        let out = PyDict::new(py);
        for (name, col) in &c.strs {
            let offsets = if col.offsets.is_empty() { vec![0] } else { col.offsets.clone() };
            out.set_item(*name, (validity(py, &col.valid), col.valid.nulls,
                                 PyBytes::new(py, as_bytes(&offsets)), PyBytes::new(py, &col.data)))?;
        }
        macro_rules! num {
            ($name:expr, $col:expr) => {
                out.set_item($name, (validity(py, &$col.valid), $col.valid.nulls,
                                     PyBytes::new(py, as_bytes(&$col.values))))?;
            };
        }
        num!("created_at", c.created_at);
        num!("schema_version", c.schema_version);
        num!("step_index", c.step_index);
        num!("policy_revision", c.policy_revision);
        num!("n_prompt_tokens", c.n_prompt_tokens);
        num!("n_completion_tokens", c.n_completion_tokens);
        num!("latency_s", c.latency_s);
        num!("_partition", c.partition);
        num!("_offset", c.offset);
        num!("_ts", c.ts);
        for (name, col) in [("trainable", &c.trainable), ("policy_exact", &c.policy_exact)] {
            let bits = if col.values.bits.is_empty() { vec![] } else { col.values.bits.clone() };
            out.set_item(name, (py.None(), 0usize, PyBytes::new(py, &bits)))?;
        }
        for (name, col) in [("prompt_token_ids", &c.prompt_token_ids), ("completion_token_ids", &c.completion_token_ids),
                            ("completion_logprobs", &c.completion_logprobs)] {
            out.set_item(name, (py.None(), 0usize, PyBytes::new(py, as_bytes(&col.offsets)), PyBytes::new(py, &col.data)))?;
        }
        Ok(out)
    }

    /// Decode one frame into a row (tests, and values that did not come through a record set): True if taken,
    /// False if the frame is left to the Python decoder.
    fn push_frame(&mut self, frame: &[u8], topic: &str, partition: i32, offset: i64, ts: i64) -> bool {
        match decode_step(frame) {
            Some(s) => {
                self.push(&s, topic, partition, offset, ts);
                self.nbytes += frame.len();
                true
            }
            None => false,
        }
    }
}

// ------------------------------------------------------------------------------------------ Step frames

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BlobRef {
    #[serde(rename = "$blob")]
    r: (i64, i64),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyRefJ<'a> {
    #[serde(borrow)]
    family: Cow<'a, str>,
    revision: i64,
    #[serde(default, borrow)]
    checkpoint_digest: Option<Cow<'a, str>>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct ToolCallJ<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow)]
    arguments: Cow<'a, str>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct ChatMessageJ<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Vec<ToolCallJ<'a>>,
    #[serde(default, borrow)]
    tool_call_id: Option<Cow<'a, str>>,
}

fn yes() -> bool {
    true
}

/// A Step's JSON header. Required fields are required here too, including those the model would fill with a
/// default factory (event_id, created_at): such a frame goes to the model.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepJ<'a> {
    #[serde(borrow)]
    event_id: Cow<'a, str>,
    #[serde(borrow)]
    event_type: Cow<'a, str>,
    schema_version: i64,
    #[serde(borrow)]
    run_id: Cow<'a, str>,
    #[serde(borrow)]
    producer: Cow<'a, str>,
    #[serde(borrow)]
    created_at: Cow<'a, str>,
    #[serde(default, borrow)]
    causation_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    step_id: Cow<'a, str>,
    #[serde(borrow)]
    rollout_id: Cow<'a, str>,
    #[serde(borrow)]
    root_group_id: Cow<'a, str>,
    index: i64,
    #[serde(borrow)]
    member_id: Cow<'a, str>,
    #[serde(borrow)]
    target: Cow<'a, str>,
    trainable: bool,
    // required, and may be null (the model has no default for it)
    #[serde(borrow, deserialize_with = "Option::deserialize")]
    policy: Option<PolicyRefJ<'a>>,
    #[serde(default = "yes")]
    policy_exact: bool,
    #[serde(borrow)]
    prompt: Vec<ChatMessageJ<'a>>,
    #[serde(borrow)]
    completion: Vec<ChatMessageJ<'a>>,
    prompt_token_ids: BlobRef,
    completion_token_ids: BlobRef,
    completion_logprobs: BlobRef,
    #[serde(borrow)]
    finish_reason: Cow<'a, str>,
    #[serde(default, borrow)]
    tool_calls: Vec<ToolCallJ<'a>>,
    latency_s: f64,
}

struct Decoded<'a> {
    header: StepJ<'a>,
    created_at_us: i64,
    prompt: String,
    completion: String,
    tool_calls: String,
    prompt_ids: &'a [u8],
    completion_ids: &'a [u8],
    logprobs: &'a [u8],
}

const MAGIC: &[u8; 4] = b"RLEV";
const FRAME_VERSION: u8 = 1;
const STEP: &[u8] = b"step";
const STEP_VERSION: u16 = 1;

/// The frame's JSON header and blob region, when it is a version-1 Step frame (`schemas.codec._split`).
fn split_step(frame: &[u8]) -> Option<(&[u8], &[u8])> {
    if frame.len() < 6 || &frame[..4] != MAGIC || frame[4] != FRAME_VERSION {
        return None;
    }
    let type_len = frame[5] as usize;
    let mut pos = 6;
    if frame.get(pos..pos + type_len)? != STEP {
        return None;
    }
    pos += type_len;
    let version = u16::from_le_bytes(frame.get(pos..pos + 2)?.try_into().ok()?);
    let header_len = u32::from_le_bytes(frame.get(pos + 2..pos + 6)?.try_into().ok()?) as usize;
    pos += 6;
    if version != STEP_VERSION {
        return None;
    }
    let header = frame.get(pos..pos.checked_add(header_len)?)?;
    let end = pos + header_len;
    let blob_start = end + ((8 - end % 8) % 8);
    Some((header, frame.get(blob_start..).unwrap_or(&[])))
}

fn blob<'a>(blobs: &'a [u8], b: &BlobRef, itemsize: i64) -> Option<&'a [u8]> {
    let (offset, count) = b.r;
    if offset < 0 || count < 0 {
        return None;
    }
    let end = offset.checked_add(count.checked_mul(itemsize)?)?;
    blobs.get(offset as usize..end as usize)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    // Howard Hinnant's algorithm: days since 1970-01-01 of a proleptic Gregorian date
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

/// Microseconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.ffffff](Z|+00:00)`, the form the models write; any
/// other form (other zones, other precisions) is left to the Python decoder.
fn utc_micros(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let body = if let Some(rest) = b.strip_suffix(b"Z") { rest } else { b.strip_suffix(b"+00:00")? };
    if !(body.len() == 19 || body.len() == 26) {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let mut v = 0i64;
        for &c in &body[r] {
            if !c.is_ascii_digit() {
                return None;
            }
            v = v * 10 + (c - b'0') as i64;
        }
        Some(v)
    };
    if body[4] != b'-' || body[7] != b'-' || body[10] != b'T' || body[13] != b':' || body[16] != b':' {
        return None;
    }
    let (y, mo, d, h, mi, se) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    let micros = if body.len() == 26 {
        if body[19] != b'.' {
            return None;
        }
        num(20..26)?
    } else {
        0
    };
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if y < 1 || !(1..=12).contains(&mo) || d < 1 || d > days_in[(mo - 1) as usize] || h > 23 || mi > 59 || se > 59 {
        return None;
    }
    Some(((days_from_civil(y, mo, d) * 24 + h) * 60 + mi) * 60_000_000 + se * 1_000_000 + micros)
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

fn messages_ok(ms: &[ChatMessageJ]) -> bool {
    ms.iter().all(|m| ROLES.contains(&m.role.as_ref()))
}

/// A Step frame the model would accept with these exact values, or None (left to the Python decoder).
fn decode_step(frame: &[u8]) -> Option<Decoded<'_>> {
    let (header, blobs) = split_step(frame)?;
    let h: StepJ = serde_json::from_slice(header).ok()?;
    let non_empty = [&h.event_id, &h.run_id, &h.producer, &h.step_id, &h.rollout_id, &h.root_group_id, &h.member_id,
                     &h.target];
    if h.event_type != "step" || h.schema_version != 1 || non_empty.iter().any(|s| s.is_empty())
        || !(0..=i32::MAX as i64).contains(&h.index) || !(h.latency_s >= 0.0) || !h.latency_s.is_finite()
        || !messages_ok(&h.prompt) || !messages_ok(&h.completion)
    {
        return None;
    }
    if let Some(p) = &h.policy {
        if p.family.is_empty() || p.revision < 0 || !p.checkpoint_digest.as_deref().map_or(true, is_sha256_hex) {
            return None;
        }
    } else if h.trainable {
        return None; // "a trainable step must name the policy revision that produced it"
    }
    let created_at_us = utc_micros(&h.created_at)?;
    let prompt_ids = blob(blobs, &h.prompt_token_ids, 4)?;
    let completion_ids = blob(blobs, &h.completion_token_ids, 4)?;
    let logprobs = blob(blobs, &h.completion_logprobs, 4)?;
    if completion_ids.len() != logprobs.len() {
        return None;
    }
    let json = |v: &[ChatMessageJ]| serde_json::to_string(v).ok();
    Some(Decoded {
        prompt: json(&h.prompt)?,
        completion: json(&h.completion)?,
        tool_calls: serde_json::to_string(&h.tool_calls).ok()?,
        created_at_us,
        prompt_ids,
        completion_ids,
        logprobs,
        header: h,
    })
}

// ------------------------------------------------------------------------------------------ record sets

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn varint(&mut self) -> Option<i64> {
        let mut shift = 0u32;
        let mut raw = 0u64;
        loop {
            let byte = *self.b.get(self.pos)?;
            self.pos += 1;
            raw |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 63 {
                return None;
            }
        }
        Some((raw >> 1) as i64 ^ -((raw & 1) as i64))
    }
    fn bytes(&mut self, len: i64) -> Option<Option<&'a [u8]>> {
        if len < 0 {
            return Some(None);
        }
        let end = self.pos.checked_add(len as usize)?;
        let out = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(Some(out))
    }
}

fn be_i64(b: &[u8], at: usize) -> i64 {
    i64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}
fn be_i32(b: &[u8], at: usize) -> i32 {
    i32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn be_i16(b: &[u8], at: usize) -> i16 {
    i16::from_be_bytes(b[at..at + 2].try_into().unwrap())
}

const BATCH_HEADER: usize = 61; // a v2 record batch's fixed header, up to and including its record count

/// The batch at `pos`: (its size, base offset, next offset); None where the record set ends (or the broker cut the
/// response inside this batch: the next fetch brings it whole); Err(base offset) for a batch too short to be one.
fn batch_at(data: &[u8], pos: usize) -> Result<Option<(usize, i64, i64)>, i64> {
    let b = &data[pos..];
    if b.len() < BATCH_HEADER {
        return Ok(None);
    }
    let base_offset = be_i64(b, 0);
    let size = 12 + be_i32(b, 8) as i64;
    if size < BATCH_HEADER as i64 {
        return Err(base_offset);
    }
    if size as usize > b.len() {
        return Ok(None);
    }
    Ok(Some((size as usize, base_offset, base_offset + be_i32(b, 23) as i64 + 1)))
}

/// One fetched partition's record set, read batch by batch; `read` may stop part-way (a full flush, a batch
/// Python must read) and resume where it stopped.
#[pyclass(module = "rollout_native")]
struct RecordSet {
    data: Py<PyBytes>,
    pos: usize,         // start of the next batch to read
    record: usize,      // records of the batch at `pos` already taken (when a read stopped inside it)
    fetch_offset: i64,  // records below it were read before (the broker sends whole batches)
    aborted: Vec<(i64, i64)>, // (producer id, first offset), by first offset, not yet reached
    aborted_producers: Vec<i64>,
    #[pyo3(get)]
    position: i64, // where the next fetch of this partition starts
    #[pyo3(get)]
    next_offset: i64, // one past the last record taken (the offset a flush records for this partition)
    #[pyo3(get)]
    other_runs: usize, // records skipped on their run_id header (or, without one, their envelope)
}

/// Why `RecordSet.read` returned.
const DONE: &str = "done"; // every complete batch read
const FULL: &str = "full"; // the step columns reached `limit` rows
const BATCH: &str = "batch"; // a batch this reader does not unpack (compressed, or an older format): Python reads it
const END: &str = "end"; // a record at or past `stop`: the partition is read
const UNTIL: &str = "until"; // a record after `until_ms`: the partition stops before it

#[pymethods]
impl RecordSet {
    /// `aborted`: the fetch response's aborted transactions, (producer id, first offset).
    #[new]
    fn new(data: Py<PyBytes>, fetch_offset: i64, mut aborted: Vec<(i64, i64)>, next_offset: i64) -> Self {
        aborted.sort_by_key(|a| a.1);
        aborted.reverse(); // popped from the end, lowest first offset first
        // where the next fetch starts: past the last complete batch (known now, so that fetch can be sent at once)
        let position = Python::attach(|py| {
            let b = data.bind(py).as_bytes();
            let (mut pos, mut end) = (0usize, fetch_offset);
            while let Ok(Some((size, _, next))) = batch_at(b, pos) {
                end = end.max(next);
                pos += size;
            }
            end
        });
        RecordSet { data, pos: 0, record: 0, fetch_offset, aborted, aborted_producers: Vec::new(), position,
                    next_offset, other_runs: 0 }
    }

    /// Read on from where the last call stopped. Steps of run `run` become rows of `cols` (up to `limit` rows
    /// in all); every other record of the run is returned, in log order, as (offset, timestamp ms, key, value,
    /// headers) for the Python decoder, which also counts it. Records of other runs (by their run_id header)
    /// are counted and skipped. Returns (why it stopped, leftovers); for "batch", also the batch's bytes: Python
    /// reads that batch, then calls `skip_batch`. The record set is read without the
    /// GIL, so replay's DuckDB writer thread runs meanwhile.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (cols, limit, stop, until_ms, run, topic, partition, check_crcs=true))]
    fn read<'py>(&mut self, py: Python<'py>, cols: &mut StepColumns, limit: usize, stop: i64, until_ms: Option<i64>,
                 run: &str, topic: &str, partition: i32, check_crcs: bool) -> PyResult<Bound<'py, PyTuple>> {
        let held = self.data.clone_ref(py); // (borrowed apart from self, which the scan updates)
        let data = held.bind(py).as_bytes();
        let (why, lefts, batch) = py
            .detach(|| self.scan(data, cols, limit, stop, until_ms, run, topic, partition, check_crcs))
            .map_err(PyValueError::new_err)?;
        let leftovers = PyList::empty(py);
        for l in &lefts {
            let hs = PyList::empty(py);
            for (k, v) in &l.headers {
                hs.append((String::from_utf8_lossy(&data[k.0..k.1]), v.map(|v| PyBytes::new(py, &data[v.0..v.1]))))?;
            }
            leftovers.append((l.offset, l.ts, l.key.map(|k| PyBytes::new(py, &data[k.0..k.1])),
                              l.value.map(|v| PyBytes::new(py, &data[v.0..v.1])), hs))?;
        }
        match batch {
            Some((start, end)) => (why, leftovers, PyBytes::new(py, &data[start..end])).into_pyobject(py),
            None => (why, leftovers).into_pyobject(py),
        }
    }

    /// Past the batch `read` returned as "batch" (Python has read its records).
    fn skip_batch(&mut self, py: Python<'_>) {
        let held = self.data.clone_ref(py);
        if let Ok(Some((size, _, next))) = batch_at(held.bind(py).as_bytes(), self.pos) {
            self.skip(size, next);
        }
    }
}

type Range = (usize, usize);

/// A record handed back to Python: where its parts lie in the record set.
struct Left {
    offset: i64,
    ts: i64,
    key: Option<Range>,
    value: Option<Range>,
    headers: Vec<(Range, Option<Range>)>,
}

impl RecordSet {
    /// `read` without Python objects: (why, leftovers, the batch Python must read: (start, end, next offset)).
    #[allow(clippy::too_many_arguments)]
    fn scan(&mut self, data: &[u8], cols: &mut StepColumns, limit: usize, stop: i64, until_ms: Option<i64>,
            run: &str, topic: &str, partition: i32, check_crcs: bool)
            -> Result<(&'static str, Vec<Left>, Option<Range>), String> {
        let mut lefts = Vec::new();
        let run_b = run.as_bytes();
        loop {
            let at = self.pos;
            let (size, base_offset, batch_next) = match batch_at(data, at) {
                Ok(Some(found)) => found,
                Ok(None) => return Ok((DONE, lefts, None)),
                Err(base) => return Err(format!("{topic}:{partition}: corrupt record batch at offset {base}")),
            };
            let batch = &data[at..at + size];
            if batch[16] != 2 {
                return Ok((BATCH, lefts, Some((at, at + size)))); // an older message format
            }
            if self.record == 0 && check_crcs {
                let crc = u32::from_be_bytes(batch[17..21].try_into().unwrap());
                if crc32c::crc32c(&batch[21..]) != crc {
                    return Err(format!("{topic}:{partition}: invalid CRC of the record batch at offset {base_offset}"));
                }
            }
            let attributes = be_i16(batch, 21);
            let transactional = attributes & 0x10 != 0;
            let control = attributes & 0x20 != 0;
            let producer_id = be_i64(batch, 43);
            // read_committed (aiokafka's PartitionRecords._unpack_records, same order of checks)
            if producer_id >= 0 && self.record == 0 {
                while let Some(&(pid, first)) = self.aborted.last() {
                    if first > base_offset {
                        break;
                    }
                    self.aborted_producers.push(pid);
                    self.aborted.pop();
                }
                if control && is_abort_marker(batch) {
                    self.aborted_producers.retain(|p| *p != producer_id);
                }
                if transactional && self.aborted_producers.contains(&producer_id) {
                    self.skip(size, batch_next);
                    continue;
                }
            }
            if control {
                self.skip(size, batch_next);
                continue;
            }
            if attributes & 0x07 != 0 {
                return Ok((BATCH, lefts, Some((at, at + size))));
            }
            let log_append = attributes & 0x08 != 0;
            let base_ts = be_i64(batch, 27);
            let max_ts = be_i64(batch, 35);
            let n_records = be_i32(batch, 57).max(0) as usize;
            let mut cur = Cursor { b: batch, pos: BATCH_HEADER };
            let corrupt = || format!("{topic}:{partition}: corrupt record in the batch at offset {base_offset}");
            let range = |s: &[u8]| {
                let start = s.as_ptr() as usize - data.as_ptr() as usize;
                (start, start + s.len())
            };
            for i in 0..n_records {
                let len = cur.varint().ok_or_else(corrupt)?;
                let start = cur.pos;
                let end = start.checked_add(len.max(0) as usize).filter(|e| *e <= batch.len()).ok_or_else(corrupt)?;
                if i < self.record {
                    cur.pos = end;
                    continue;
                }
                cur.pos += 1; // attributes
                let ts_delta = cur.varint().ok_or_else(corrupt)?;
                let off = base_offset + cur.varint().ok_or_else(corrupt)?;
                let key_len = cur.varint().ok_or_else(corrupt)?;
                let key = cur.bytes(key_len).ok_or_else(corrupt)?;
                let value_len = cur.varint().ok_or_else(corrupt)?;
                let value = cur.bytes(value_len).ok_or_else(corrupt)?;
                let n_headers = cur.varint().ok_or_else(corrupt)?;
                let mut headers: Vec<(&[u8], Option<&[u8]>)> = Vec::with_capacity(n_headers.clamp(0, 16) as usize);
                for _ in 0..n_headers {
                    let hk_len = cur.varint().ok_or_else(corrupt)?;
                    let hk = cur.bytes(hk_len).ok_or_else(corrupt)?.ok_or_else(corrupt)?;
                    let hv_len = cur.varint().ok_or_else(corrupt)?;
                    headers.push((hk, cur.bytes(hv_len).ok_or_else(corrupt)?));
                }
                if cur.pos != end {
                    return Err(corrupt());
                }
                if off < self.fetch_offset {
                    continue;
                }
                if off >= stop {
                    return Ok((END, lefts, None));
                }
                let ts = if log_append { max_ts } else { base_ts + ts_delta };
                if until_ms.is_some_and(|u| ts > u) {
                    return Ok((UNTIL, lefts, None));
                }
                self.next_offset = off + 1;
                self.record = i + 1;
                // a run_id header with a null value counts as none, as in the Python loop
                let hrun = headers.iter().find(|(k, _)| *k == b"run_id").and_then(|(_, v)| *v);
                if hrun.is_some_and(|h| h != run_b) {
                    self.other_runs += 1;
                    continue;
                }
                if let Some(step) = value.and_then(decode_step) {
                    if step.header.run_id != run {
                        if hrun.is_none() {
                            self.other_runs += 1; // no header: the envelope decides
                            continue;
                        }
                        // header and envelope disagree: the Python decoder reports it
                    } else {
                        cols.push(&step, topic, partition, off, ts);
                        cols.nbytes += value.map_or(0, |v| v.len());
                        if cols.rows >= limit {
                            if i + 1 == n_records {
                                self.skip(size, batch_next);
                            }
                            return Ok((FULL, lefts, None));
                        }
                        continue;
                    }
                }
                lefts.push(Left { offset: off, ts, key: key.map(range), value: value.map(range),
                                  headers: headers.iter().map(|(k, v)| (range(k), v.map(range))).collect() });
            }
            self.skip(size, batch_next);
        }
    }

    fn skip(&mut self, size: usize, batch_next: i64) {
        self.pos += size;
        self.record = 0;
        self.position = self.position.max(batch_next);
    }
}

fn is_abort_marker(batch: &[u8]) -> bool {
    // a control batch's one record has a key of (version int16, type int16); type 0 is ABORT
    let mut cur = Cursor { b: batch, pos: BATCH_HEADER };
    (|| {
        cur.varint()?;
        cur.pos += 1;
        cur.varint()?;
        cur.varint()?;
        let key_len = cur.varint()?;
        let key = cur.bytes(key_len)??;
        (key.len() >= 4).then(|| be_i16(key, 2) == 0)
    })()
    .unwrap_or(false)
}

#[pymodule]
fn rollout_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepColumns>()?;
    m.add_class::<RecordSet>()?;
    m.add("STEP_COLUMNS", STR_COLUMNS.to_vec())?;
    Ok(())
}
