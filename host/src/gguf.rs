//! A GGUF reader (versions 2 and 3, little-endian) over a memory map.
//!
//! The header (metadata and tensor infos) is parsed into owned values; tensor data stays in the
//! map and is handed out as zero-copy slices, so opening a file touches only its header pages.
//! Everything a malformed file could get wrong is checked here, once, so that later code can
//! index tensor data without bounds surprises.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::quant::GgmlType;
use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays of arrays are legal; a bound on the nesting keeps a hostile file from exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 8;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type whose value is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => v.try_into().ok(),
            Value::I16(v) => v.try_into().ok(),
            Value::I32(v) => v.try_into().ok(),
            Value::I64(v) => v.try_into().ok(),
            _ => None,
        }
    }

    /// F32, or F64 rounded to f32.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages and `inspect`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// Where one tensor's data lies in the file and how to read it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `shape[0]` is the row length (the contiguous dimension).
    pub shape: Vec<u64>,
    /// Absolute file offset of the data.
    pub offset: u64,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn n_elems(&self) -> u64 {
        // Cannot overflow: `open` checked the product.
        self.shape.iter().product()
    }
}

/// An open GGUF file: its parsed header and its memory-mapped data.
pub struct Gguf {
    path: PathBuf,
    map: Mmap,
    header: Header,
}

impl Gguf {
    /// Maps the file and parses and validates its header and tensor layout. No tensor data is read.
    pub fn open(path: &Path) -> Result<Gguf> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        // Checked before opening: opening a named pipe would wait for a writer.
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            let what = if meta.is_dir() {
                "a directory"
            } else {
                "a pipe, socket or device"
            };
            return Err(Error::Gguf {
                path: path.to_path_buf(),
                msg: format!("is {what}, not a GGUF file"),
            });
        }
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. Like every mmap-based loader, we rely on the file not
        // being truncated underneath us while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse(path, &map)?;
        Ok(Gguf {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// `general.alignment`, or the default of 32.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    pub fn file_size(&self) -> u64 {
        self.map.len() as u64
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let h = &self.header;
        h.metadata_index.get(key).map(|&i| &h.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "a string", Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "a float", Value::as_f32)
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let items = self.typed(key, "an array of strings", Value::as_array)?;
        items
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    self.error(format!(
                        "metadata key '{key}' is an array of {}, expected an array of strings",
                        v.type_name()
                    ))
                })
            })
            .collect()
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        match self.header.tensor_index.get(name) {
            Some(&i) => Ok(&self.header.tensors[i]),
            None => Err(self.error(format!("no tensor named '{name}'"))),
        }
    }

    /// The tensor's data, borrowed from the map.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        // In bounds for every tensor of this file: `open` checked it.
        &self.map[t.offset as usize..(t.offset + t.bytes) as usize]
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        cast: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<T> {
        let value = self
            .get(key)
            .ok_or_else(|| self.error(format!("missing metadata key '{key}'")))?;
        cast(value).ok_or_else(|| {
            self.error(format!(
                "metadata key '{key}' is {}, expected {expected}",
                value.type_name()
            ))
        })
    }

    fn error(&self, msg: String) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            msg,
        }
    }
}

/// Counts only: the metadata of a model runs to hundreds of thousands of values.
impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

/// What `parse` reads of a file: everything but the tensor data.
struct Header {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

fn parse(path: &Path, buf: &[u8]) -> Result<Header> {
    let mut r = Reader {
        path,
        buf,
        pos: 0,
        ctx: "magic".into(),
    };
    let magic = r.take(4)?;
    if magic != MAGIC {
        // Shown as text (escaped where not printable ASCII), as a user would recognise it.
        let shown: String = magic
            .iter()
            .flat_map(|b| b.escape_ascii())
            .map(char::from)
            .collect();
        return Err(r.error(format!(
            "not a GGUF file: it starts with \"{shown}\", not \"GGUF\""
        )));
    }
    r.ctx = "version".into();
    let version = r.u32()?;
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 1..=3) => {
            return Err(r.error(format!(
                "unsupported GGUF version {v}: a big-endian file (only little-endian is supported)"
            )));
        }
        v => return Err(r.error(format!("unsupported GGUF version {v} (supported: 2 and 3)"))),
    }
    r.ctx = "tensor count".into();
    let n_tensors = r.u64()?;
    r.ctx = "metadata count".into();
    let n_metadata = r.u64()?;
    // Bound counts by what the rest of the file could hold before allocating for them.
    // Smallest entry: empty key (8-byte length), type (4), a one-byte value.
    r.check_count(n_metadata, 8 + 4 + 1, "metadata count")?;

    let mut metadata = Vec::with_capacity(n_metadata as usize);
    let mut metadata_index = HashMap::with_capacity(n_metadata as usize);
    for i in 0..n_metadata {
        r.ctx = format!("metadata entry {i}");
        let key = r.string()?;
        r.ctx = format!("metadata entry {i} '{key}'");
        let ty = r.u32()?;
        let value = r.value(ty, 0)?;
        if metadata_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(r.error(format!("duplicate metadata key '{key}'")));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata_index.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => match metadata[i].1.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            Some(a) => {
                return Err(r.error(format!(
                    "general.alignment {a} is not a nonzero power of two"
                )));
            }
            None => {
                let ty = metadata[i].1.type_name();
                return Err(r.error(format!(
                    "general.alignment is {ty}, expected an unsigned integer"
                )));
            }
        },
    };

    r.ctx = "tensor count".into();
    // Smallest info: empty name (8-byte length), n_dims (4), one dim (8), type (4), offset (8).
    r.check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor count")?;
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        r.ctx = format!("tensor info {i}");
        let name = r.string()?;
        r.ctx = format!("tensor info {i} '{name}'");
        let t = r.tensor_info(name)?;
        if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
            return Err(r.error(format!("duplicate tensor name '{}'", t.name)));
        }
        tensors.push(t);
    }

    // Offsets in tensor infos are relative to the data section, which starts aligned.
    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let file_len = buf.len() as u64;
    for t in &mut tensors {
        let name = &t.name;
        if t.offset % alignment != 0 {
            return Err(r.error(format!(
                "tensor '{name}' data offset {} is misaligned (alignment {alignment})",
                t.offset
            )));
        }
        let start = data_start.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => t.offset = start,
            (Some(start), Some(end)) if start < file_len => {
                return Err(r.error(format!("truncated data: tensor '{name}' ends at byte {end} past the end of the file ({file_len} bytes)")));
            }
            _ => {
                return Err(r.error(format!("tensor '{name}' data offset {} is out of bounds of the file ({file_len} bytes)", t.offset)));
            }
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for w in by_offset.windows(2) {
        if w[0].offset + w[0].bytes > w[1].offset {
            return Err(r.error(format!(
                "tensor data of '{}' and '{}' overlap",
                w[0].name, w[1].name
            )));
        }
    }

    Ok(Header {
        version,
        alignment,
        metadata,
        metadata_index,
        tensors,
        tensor_index,
    })
}

/// A cursor over the header. `ctx` names what is being read, for error messages.
struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
    ctx: String,
}

impl<'a> Reader<'a> {
    fn error(&self, msg: String) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            msg,
        }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n as u64 > self.remaining() {
            let end = self.pos as u64 + n as u64;
            let len = self.buf.len();
            return Err(self.error(format!(
                "truncated header: {} ends at byte {end} past the end of the file ({len} bytes)",
                self.ctx
            )));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Fails if `count` items of at least `min_bytes` each cannot fit in the rest of the file,
    /// before anything is allocated for them.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> Result<()> {
        if count > self.remaining() / min_bytes {
            let left = self.remaining();
            return Err(self.error(format!("{what} {count} exceeds the rest of the file (at least {min_bytes} bytes each, {left} bytes left)")));
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > self.remaining() {
            let left = self.remaining();
            return Err(self.error(format!(
                "{}: string length {len} exceeds the rest of the file ({left} bytes left)",
                self.ctx
            )));
        }
        let bytes = self.take(len as usize)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.error(format!("{}: string is not valid UTF-8 ({e})", self.ctx))),
        }
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8()?),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(
                        self.error(format!("{}: bool byte {b} is neither 0 nor 1", self.ctx))
                    );
                }
            },
            8 => Value::String(self.string()?),
            9 => {
                let elem_ty = self.u32()?;
                let count = self.u64()?;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.error(format!(
                        "{}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                        self.ctx
                    )));
                }
                let elem_bytes = min_value_bytes(elem_ty).ok_or_else(|| {
                    self.error(format!(
                        "{}: unknown array element type {elem_ty}",
                        self.ctx
                    ))
                })?;
                self.check_count(count, elem_bytes, &format!("{}: array count", self.ctx))?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            _ => return Err(self.error(format!("{}: unknown metadata value type {ty}", self.ctx))),
        })
    }

    /// The rest of a tensor info after its name; `offset` is still relative to the data section.
    fn tensor_info(&mut self, name: String) -> Result<TensorInfo> {
        let n_dims = self.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(self.error(format!(
                "tensor '{name}' has {n_dims} dimensions (expected 1 to {MAX_DIMS})"
            )));
        }
        let shape = (0..n_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<u64>>>()?;
        let type_id = self.u32()?;
        let offset = self.u64()?;
        if shape.contains(&0) {
            return Err(self.error(format!(
                "tensor '{name}' has a zero dimension in shape {shape:?}"
            )));
        }
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(self.error(format!(
                "tensor '{name}' has unknown tensor type id {type_id}"
            )));
        };
        let overflow = || self.error(format!("tensor '{name}' shape {shape:?} overflows"));
        let rows = shape[1..]
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(overflow)?;
        shape[0].checked_mul(rows).ok_or_else(overflow)?;
        let block = ty.block_elems() as u64;
        if !shape[0].is_multiple_of(block) {
            return Err(self.error(format!(
                "tensor '{name}' row length {} is not a multiple of the {} block size {block}",
                shape[0],
                ty.name()
            )));
        }
        let bytes = (shape[0] / block)
            .checked_mul(ty.block_bytes() as u64)
            .and_then(|row| row.checked_mul(rows))
            .ok_or_else(overflow)?;
        Ok(TensorInfo {
            name,
            ty,
            shape,
            offset,
            bytes,
        })
    }
}

/// The fewest bytes a value of metadata type `ty` takes, or `None` for an unknown type.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}
