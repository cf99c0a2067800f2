//! The core's `Store` over process memory: what Envoy's shared data is to
//! the wasm build, shared by every worker of this Envoy (plain memory is,
//! in a dynamic module).
//!
//! The semantics are shared data's (proxy-wasm's `SharedData`, which
//! `src/host/store.rs` maps): each write gives the key a new version, a
//! non-zero 32-bit number from one counter that wraps; `get` answers the
//! bytes and that version as the CAS token; `set` with a token fails with
//! `CasMismatch` if the key's version is another, and `set` without one
//! (or with one for a key never written) writes unconditionally. Keys are
//! never deleted, as in shared data. Bounded: a new key beyond
//! [`MAX_KEYS`], or a value over [`MAX_VALUE`] bytes, is refused as
//! `Unavailable` (every mechanism then applies its failure policy).
//!
//! Layout: 16 shards, each under its own lock, so workers touching
//! different keys rarely wait for each other. The keys of tables of slots
//! (rate-limit rules' `sl1f2e3d4c/12345`, bulkheads' `bh...`: two letters,
//! the table's 8 hex digits, `/`, the slot, as `sluice::store::SlotKey`
//! writes them; most of the store) are kept without their text, read by
//! number (`get_slot`) or by text alike: a table's slots in chunks of
//! [`CHUNK`] cells, each cell its
//! value (inline up to `value::INLINE` bytes, a slot's 21 among them) and
//! version, about 32 bytes a slot. Any other key is kept by its text. One
//! fast hash per access picks the shard and the entry.

use hashbrown::HashTable;
use sluice::store::{get_slot_by_text, Entry, SlotKey, SmallEntry, Store, StoreError};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use value::Cell;

/// Shards, each a map under its own lock.
const SHARDS: usize = 16;
/// The most keys the store holds (sluice's keys are per table slot, not
/// per client: a configuration needs a bounded number of them).
pub const MAX_KEYS: usize = 1 << 20;
/// The largest value the store accepts.
pub const MAX_VALUE: usize = 1 << 20;
/// Slots per chunk of a table.
const CHUNK: u32 = 64;
/// Slots numbered from here on are kept by their text, as other keys are
/// (tables are smaller: their slots are below `MAX_KEYS`).
const DENSE_SLOTS: u32 = MAX_KEYS as u32;

/// A key, as the store keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key<'a> {
    /// Slot `slot` of table `table` (its kind's two letters and its id).
    Slot {
        table: u64,
        slot: u32,
    },
    Other(&'a str),
}

impl<'a> Key<'a> {
    /// The key of `text`: a slot's when it has exactly the text
    /// `SlotKey::text` writes (lower-case letters and hex, no leading
    /// zero), so that every text has one place.
    fn of(text: &'a str) -> Self {
        slot_of(text.as_bytes())
            .and_then(Key::numbered)
            .unwrap_or(Key::Other(text))
    }

    /// A slot's key, if it is kept by number: its kind lower-case letters
    /// and the slot within the tables' sizes (else by text).
    fn numbered(k: SlotKey) -> Option<Self> {
        let [a, b] = k.kind;
        let ok = k.kind.iter().all(u8::is_ascii_lowercase) && k.slot < DENSE_SLOTS;
        ok.then_some(Key::Slot {
            table: u64::from(a) << 40 | u64::from(b) << 32 | u64::from(k.table),
            slot: k.slot,
        })
    }
}

/// The slot key of a text, if it is one kept by number.
fn slot_of(b: &[u8]) -> Option<SlotKey> {
    let (head, digits) = (b.get(..11)?, b.get(11..)?);
    let (kind, rest) = head.split_at(2);
    let (hex, slash) = rest.split_at(8);
    let kind: [u8; 2] = kind.try_into().ok()?;
    if !kind.iter().all(u8::is_ascii_lowercase) || slash != b"/" {
        return None;
    }
    if digits.is_empty() || digits.len() > 10 {
        return None;
    }
    if digits.len() > 1 && digits.first() == Some(&b'0') {
        return None;
    }
    let mut table = 0u32;
    for &c in hex {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        table = table << 4 | u32::from(d);
    }
    let mut slot = 0u64;
    for &c in digits {
        if !c.is_ascii_digit() {
            return None;
        }
        slot = slot * 10 + u64::from(c - b'0');
    }
    let slot = u32::try_from(slot).ok()?;
    Some(SlotKey { kind, table, slot })
}

/// A chunk of a table's slots.
struct Chunk {
    /// The table (see [`Key::Slot`]) and the chunk's number.
    id: (u64, u32),
    cells: Box<[Cell]>,
}

/// A key kept by its text.
struct Named {
    hash: u64,
    key: Box<str>,
    cell: Cell,
}

/// One shard.
#[derive(Default)]
struct Shard {
    chunks: HashTable<Chunk>,
    named: HashTable<Named>,
}

impl Shard {
    /// The cell of a key, if it was ever written.
    fn find(&mut self, key: Key<'_>, hash: u64) -> Option<&mut Cell> {
        let cell = match key {
            Key::Slot { table, slot } => {
                let id = chunk_id(table, slot);
                let chunk = self.chunks.find_mut(hash, |c| c.id == id)?;
                chunk.cells.get_mut((slot % CHUNK) as usize)?
            }
            Key::Other(text) => &mut self.named.find_mut(hash, |n| &*n.key == text)?.cell,
        };
        (cell.version != 0).then_some(cell)
    }

    /// The cell of a key never written, made (in a chunk made if need be).
    fn make(&mut self, key: Key<'_>, hash: u64) -> Option<&mut Cell> {
        match key {
            Key::Slot { table, slot } => {
                let id = chunk_id(table, slot);
                let chunk = self
                    .chunks
                    .entry(hash, |c| c.id == id, |c| chunk_hash(c.id))
                    .or_insert_with(|| Chunk {
                        id,
                        cells: (0..CHUNK).map(|_| Cell::default()).collect(),
                    })
                    .into_mut();
                chunk.cells.get_mut((slot % CHUNK) as usize)
            }
            Key::Other(text) => {
                let named = Named {
                    hash,
                    key: text.into(),
                    cell: Cell::default(),
                };
                let e = self.named.insert_unique(hash, named, |n| n.hash);
                Some(&mut e.into_mut().cell)
            }
        }
    }
}

fn chunk_id(table: u64, slot: u32) -> (u64, u32) {
    (table, slot / CHUNK)
}

/// The one fast hash (keys are not chosen by clients: slots come from the
/// keyed table hash; other keys are the mechanisms' own).
fn chunk_hash(id: (u64, u32)) -> u64 {
    foldhash::fast::FixedState::default().hash_one(id)
}

fn key_hash(key: Key<'_>) -> u64 {
    match key {
        Key::Slot { table, slot } => chunk_hash(chunk_id(table, slot)),
        Key::Other(text) => foldhash::fast::FixedState::default().hash_one(text),
    }
}

/// The process's store.
pub struct ProcessStore {
    shards: [Mutex<Shard>; SHARDS],
    version: AtomicU32,
    keys: AtomicU32,
}

impl Default for ProcessStore {
    fn default() -> Self {
        ProcessStore {
            shards: std::array::from_fn(|_| Mutex::default()),
            version: AtomicU32::new(1),
            keys: AtomicU32::new(0),
        }
    }
}

/// The one store of this process (every configuration and worker).
pub fn shared() -> &'static ProcessStore {
    static STORE: OnceLock<ProcessStore> = OnceLock::new();
    STORE.get_or_init(ProcessStore::default)
}

impl ProcessStore {
    /// The key's hash, and its shard, locked.
    fn lock(&self, key: Key<'_>) -> Result<(u64, MutexGuard<'_, Shard>), StoreError> {
        let hash = key_hash(key);
        // Bits the tables' bucket index and control bytes do not use.
        let i = (hash >> 32) as usize % SHARDS;
        let [first, ..] = &self.shards;
        let shard = self.shards.get(i).unwrap_or(first);
        // A panic while a shard was locked leaves every value whole (each
        // write is one assignment): the shard stays in use.
        let guard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        Ok((hash, guard))
    }

    fn write(&self, key: Key<'_>, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if value.len() > MAX_VALUE {
            return Err(StoreError::Unavailable);
        }
        let (hash, mut shard) = self.lock(key)?;
        if let Some(cell) = shard.find(key, hash) {
            if matches!(cas, Some(c) if c != 0 && c != cell.version) {
                return Err(StoreError::CasMismatch);
            }
            cell.write(value, self.next_version());
            return Ok(());
        }
        self.admit_key()?;
        let cell = shard.make(key, hash).ok_or(StoreError::Unavailable)?;
        cell.write(value, self.next_version());
        Ok(())
    }

    /// The next version: never 0 (0 means "no token" to shared data, and
    /// a cell never written here).
    fn next_version(&self) -> u32 {
        loop {
            let v = self.version.fetch_add(1, Ordering::Relaxed);
            if v != 0 {
                return v;
            }
        }
    }

    /// Counts a new key, if there is room for it (never past
    /// [`MAX_KEYS`], however many workers add keys at once).
    fn admit_key(&self) -> Result<(), StoreError> {
        self.keys
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                ((n as usize) < MAX_KEYS).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| StoreError::Unavailable)
    }
}

impl Store for ProcessStore {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let (hash, mut shard) = self.lock(Key::of(key))?;
        let found = shard.find(Key::of(key), hash);
        Ok(found.map(|c| Entry::read(c.value.bytes().into(), Some(c.version))))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.write(Key::of(key), value, cas)
    }

    /// By number: the text is neither written nor read.
    fn get_slot(&self, key: SlotKey, fresh: bool) -> Result<Option<SmallEntry>, StoreError> {
        let Some(key) = Key::numbered(key) else {
            return get_slot_by_text(self, key, fresh);
        };
        let (hash, mut shard) = self.lock(key)?;
        let found = shard.find(key, hash);
        Ok(found.map(|c| SmallEntry::new(c.value.bytes(), Some(c.version), false)))
    }

    fn set_slot(&self, key: SlotKey, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match Key::numbered(key) {
            Some(k) => self.write(k, value, cas),
            None => self.write(Key::Other(&key.text()), value, cas),
        }
    }
}

#[cfg(test)]
mod tests;
mod value;
