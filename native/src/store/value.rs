//! One stored value and its version, in as little memory as a slot of a
//! rate-limit table allows: short values inline, longer ones on the heap.

/// The longest value kept inline (a rate-limit slot is 21 bytes).
pub const INLINE: usize = 22;

/// A value's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl Default for Value {
    fn default() -> Self {
        Value::Inline {
            len: 0,
            bytes: [0; INLINE],
        }
    }
}

impl Value {
    pub fn of(v: &[u8]) -> Self {
        let mut bytes = [0; INLINE];
        match (bytes.get_mut(..v.len()), u8::try_from(v.len())) {
            (Some(dst), Ok(len)) => {
                dst.copy_from_slice(v);
                Value::Inline { len, bytes }
            }
            _ => Value::Heap(v.into()),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Value::Inline { len, bytes } => bytes.get(..usize::from(*len)).unwrap_or_default(),
            Value::Heap(b) => b,
        }
    }
}

/// A key's place: its value and version (0: never written).
#[derive(Debug, Default)]
pub struct Cell {
    pub value: Value,
    pub version: u32,
}

impl Cell {
    pub fn write(&mut self, v: &[u8], version: u32) {
        self.value = Value::of(v);
        self.version = version;
    }
}
