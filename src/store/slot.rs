//! Keys of tables of numbered slots, and short values read without a heap
//! allocation: what a rate-limit rule reads and writes on every request.
//!
//! A slot's key is one text (`sl1f2e3d4c/12345`: the table's kind, its id
//! in 8 lower-case hex digits, `/`, the slot in decimal), which every
//! store keeps it under; [`SlotKey`] is that text as numbers, so a store
//! that can keep slots by their numbers (the native build's) need not
//! write or read the text.

use super::{Entry, Store, StoreError};

/// The longest text of a [`SlotKey`]: 2 + 8 + 1 + 10.
const KEY_LEN: usize = 21;
/// The longest value a [`SmallEntry`] holds.
pub const SMALL: usize = 24;

/// Slot `slot` of table `table` of kind `kind` (`*b"sl"`: a rate-limit rule's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotKey {
    pub kind: [u8; 2],
    pub table: u32,
    pub slot: u32,
}

/// The text of a [`SlotKey`], on the stack.
pub struct KeyText {
    len: usize,
    buf: [u8; KEY_LEN],
}

impl std::ops::Deref for KeyText {
    type Target = str;

    fn deref(&self) -> &str {
        let bytes = self.buf.get(..self.len).unwrap_or_default();
        std::str::from_utf8(bytes).unwrap_or_default()
    }
}

impl SlotKey {
    /// The prefix of every slot key of a table: kind, id, `/`.
    pub fn prefix(kind: [u8; 2], table: u32) -> String {
        let key = SlotKey {
            kind,
            table,
            slot: 0,
        };
        let mut p = key.text().to_string();
        p.pop();
        p
    }

    /// The key's text (what `keys::slot_key` writes for its prefix).
    pub fn text(&self) -> KeyText {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut buf = [0u8; KEY_LEN];
        let mut len = 0;
        let mut put = |b: u8| {
            if let Some(d) = buf.get_mut(len) {
                *d = if b.is_ascii() { b } else { b'?' };
                len += 1;
            }
        };
        self.kind.iter().for_each(|&b| put(b));
        for shift in (0..8).rev() {
            put(HEX
                .get((self.table >> (shift * 4)) as usize & 15)
                .copied()
                .unwrap_or(b'0'));
        }
        put(b'/');
        let mut digits = [0u8; 10];
        let mut n = self.slot;
        let mut start = digits.len();
        while start > 0 {
            start -= 1;
            if let Some(d) = digits.get_mut(start) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
            if n == 0 {
                break;
            }
        }
        digits
            .get(start..)
            .unwrap_or_default()
            .iter()
            .for_each(|&b| put(b));
        KeyText { len, buf }
    }
}

/// A value read with its CAS token, its bytes kept inline when they are
/// at most [`SMALL`] (a longer one is only known to be longer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmallEntry {
    /// `None`: longer than [`SMALL`] bytes.
    len: Option<usize>,
    buf: [u8; SMALL],
    pub cas: Option<u32>,
    /// As [`Entry::remembered`].
    pub remembered: bool,
}

impl SmallEntry {
    /// An entry of these bytes.
    pub fn new(bytes: &[u8], cas: Option<u32>, remembered: bool) -> Self {
        let mut buf = [0; SMALL];
        let len = buf.get_mut(..bytes.len()).map(|dst| {
            dst.copy_from_slice(bytes);
            bytes.len()
        });
        SmallEntry {
            len,
            buf,
            cas,
            remembered,
        }
    }

    /// The bytes, unless longer than [`SMALL`].
    pub fn bytes(&self) -> Option<&[u8]> {
        self.buf.get(..self.len?)
    }
}

impl From<&Entry> for SmallEntry {
    fn from(e: &Entry) -> Self {
        SmallEntry::new(&e.bytes, e.cas, e.remembered)
    }
}

/// `get` or `get_for_update` of a slot through its text: what
/// [`Store::get_slot`] does unless a store keeps slots by number.
pub fn get_slot_by_text(
    store: &(impl Store + ?Sized),
    key: SlotKey,
    fresh: bool,
) -> Result<Option<SmallEntry>, StoreError> {
    let text = key.text();
    let found = if fresh {
        store.get(&text)?
    } else {
        store.get_for_update(&text)?
    };
    Ok(found.as_ref().map(SmallEntry::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_slot_key_is_the_text_keys_slot_key_writes() {
        for (table, slot) in [(0, 0), (0x1f2e_3d4c, 12_345), (u32::MAX, u32::MAX), (7, 10)] {
            let prefix = format!("sl{table:08x}/");
            assert_eq!(SlotKey::prefix(*b"sl", table), prefix);
            let key = SlotKey {
                kind: *b"sl",
                table,
                slot,
            };
            assert_eq!(&*key.text(), crate::keys::slot_key(&prefix, slot));
        }
    }

    #[test]
    fn a_small_entry_holds_short_values_and_knows_longer_ones() {
        let e = SmallEntry::new(b"abc", Some(3), true);
        assert_eq!(e.bytes(), Some(&b"abc"[..]));
        assert_eq!(
            SmallEntry::new(&[7; SMALL], None, false).bytes(),
            Some(&[7; SMALL][..])
        );
        assert_eq!(SmallEntry::new(&[7; SMALL + 1], None, false).bytes(), None);
    }
}
