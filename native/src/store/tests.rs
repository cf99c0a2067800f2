use super::*;
use sluice::store::{update, Update};
use std::sync::Arc;

#[test]
fn versions_and_compare_and_swap() {
    let s = ProcessStore::default();
    assert_eq!(s.get("k"), Ok(None));
    // A token for a key never written: written (as shared data does).
    s.set("k", b"a", Some(7)).unwrap();
    let e = s.get("k").unwrap().unwrap();
    assert_eq!(e.bytes, b"a");
    let v1 = e.cas.unwrap();
    assert_ne!(v1, 0);
    s.set("k", b"b", Some(v1)).unwrap();
    // The old token no longer matches.
    assert_eq!(s.set("k", b"c", Some(v1)), Err(StoreError::CasMismatch));
    let v2 = s.get("k").unwrap().unwrap().cas.unwrap();
    assert_ne!(v1, v2);
    // Without a token: unconditional.
    s.set("k", b"d", None).unwrap();
    assert_eq!(s.get("k").unwrap().unwrap().bytes, b"d");
}

#[test]
fn the_version_counter_skips_zero_when_it_wraps() {
    let s = ProcessStore::default();
    s.version.store(u32::MAX, Ordering::Relaxed);
    s.set("a", b"1", None).unwrap();
    s.set("b", b"1", None).unwrap();
    assert_eq!(s.get("a").unwrap().unwrap().cas, Some(u32::MAX));
    assert_eq!(s.get("b").unwrap().unwrap().cas, Some(1));
}

#[test]
fn bounded() {
    let s = ProcessStore::default();
    assert_eq!(
        s.set("big", &vec![0; MAX_VALUE + 1], None),
        Err(StoreError::Unavailable)
    );
    s.keys.store(MAX_KEYS as u32, Ordering::Relaxed);
    assert_eq!(s.set("new", b"x", None), Err(StoreError::Unavailable));
}

/// Counters updated by compare-and-swap from several threads lose no
/// update: the exactness every mechanism relies on across workers.
#[test]
fn no_update_is_lost_across_threads() {
    let s = Arc::new(ProcessStore::default());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                for _ in 0..2000 {
                    update(&*s, "n", u32::MAX, |e| {
                        let n = e.map_or(0u64, |e| {
                            u64::from_le_bytes(e.bytes[..8].try_into().unwrap())
                        });
                        Update::Write((n + 1).to_le_bytes(), ())
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let n = s.get("n").unwrap().unwrap().bytes;
    assert_eq!(u64::from_le_bytes(n[..8].try_into().unwrap()), 8000);
}

#[test]
fn slot_keys_are_read_only_in_the_form_the_core_writes() {
    let k = |kind: &[u8; 2], table, slot| {
        Key::numbered(SlotKey {
            kind: *kind,
            table,
            slot,
        })
    };
    assert_eq!(Key::of("sl0a1b2c3d/0"), k(b"sl", 0x0a1b_2c3d, 0).unwrap());
    assert_eq!(
        Key::of("slffffffff/1048575"),
        k(b"sl", u32::MAX, 1_048_575).unwrap()
    );
    assert_eq!(Key::of("bh00000001/2"), k(b"bh", 1, 2).unwrap());
    assert_eq!(
        Key::of(&sluice::keys::slot_key("sl00c0ffee/", 12_345)),
        k(b"sl", 0xc0ffee, 12_345).unwrap()
    );
    // Beyond the tables' sizes, or of another kind: by text.
    assert_eq!(k(b"sl", 1, 1 << 20), None);
    assert_eq!(k(b"S1", 1, 1), None);
    for other in [
        "sl0A1B2C3D/0", // upper-case hex
        "sl0a1b2c3d/01",
        "sl0a1b2c3d/",
        "sl0a1b2c3/0",
        "sl0a1b2c3d-0",
        "x10a1b2c3d/0",
        "sl0a1b2c3d/1x",
        "sl0a1b2c3d/1048576", // beyond the dense slots
        "sl0a1b2c3d/99999999999",
        "Sl0a1b2c3d/1",
        "seed",
    ] {
        assert_eq!(Key::of(other), Key::Other(other), "{other}");
    }
}

/// Keys that look alike but are not the same text are distinct keys.
#[test]
fn every_text_is_its_own_key() {
    let s = ProcessStore::default();
    let keys = [
        "sl0a1b2c3d/7",
        "sl0A1B2C3D/7",
        "sl0a1b2c3d/07",
        "sl0a1b2c3d/71",
        "sl0a1b2c3e/7",
        "sl0a1b2c3d/2000000",
        "other",
    ];
    for (i, k) in keys.iter().enumerate() {
        s.set(k, &[i as u8], None).unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(s.get(k).unwrap().unwrap().bytes, [i as u8], "{k}");
    }
    assert_eq!(s.get("sl0a1b2c3d/8"), Ok(None));
    assert_eq!(s.get("sl0a1b2c3d/6"), Ok(None));
    assert_eq!(s.keys.load(Ordering::Relaxed), keys.len() as u32);
}

/// Values of any length, in slot keys and others, with their versions.
#[test]
fn values_of_any_length_are_kept() {
    let s = ProcessStore::default();
    for key in ["sl00000001/3", "named"] {
        for len in [0, 1, 21, INLINE_LEN, INLINE_LEN + 1, 1000] {
            let v: Vec<u8> = (0..len).map(|i| i as u8).collect();
            s.set(key, &v, None).unwrap();
            let e = s.get(key).unwrap().unwrap();
            assert_eq!(e.bytes, v);
            assert_ne!(e.cas, None);
        }
    }
}

const INLINE_LEN: usize = value::INLINE;

/// A table's slots over many chunks, each with its own version.
#[test]
fn a_large_table_keeps_each_slot() {
    let s = ProcessStore::default();
    let key = |i: u32| sluice::keys::slot_key("sl12345678/", i);
    for i in 0..1000 {
        s.set(&key(i), &i.to_le_bytes(), None).unwrap();
    }
    let mut versions = std::collections::HashSet::new();
    for i in 0..1000 {
        let e = s.get(&key(i)).unwrap().unwrap();
        assert_eq!(e.bytes, i.to_le_bytes());
        assert!(versions.insert(e.cas.unwrap()));
    }
}

#[test]
fn a_cell_is_small() {
    assert!(std::mem::size_of::<value::Cell>() <= 32);
}

/// A slot read or written by number is the key of its text, whichever
/// way it is kept.
#[test]
fn a_slot_by_number_is_the_slot_by_text() {
    let s = ProcessStore::default();
    for (kind, slot) in [(*b"sl", 5), (*b"bh", 6), (*b"sl", 1 << 20), (*b"S1", 7)] {
        let key = SlotKey {
            kind,
            table: 0xabc,
            slot,
        };
        s.set(&key.text(), b"by text", None).unwrap();
        let e = s.get_slot(key, false).unwrap().unwrap();
        assert_eq!(e.bytes(), Some(&b"by text"[..]));
        s.set_slot(key, b"by number", e.cas).unwrap();
        let by_text = s.get(&key.text()).unwrap().unwrap();
        assert_eq!(by_text.bytes, b"by number");
        assert_eq!(s.set_slot(key, b"x", e.cas), Err(StoreError::CasMismatch));
    }
}
