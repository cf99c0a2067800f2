//! Sorting the few items sluice sorts on a request's path (a request's
//! rule reports, a shared entry's claims, two waiters) with an insertion
//! sort: for a handful of items it does less
//! work than the standard library's sorts, and it is a few hundred bytes
//! of code where each of their instantiations is several kilobytes (code
//! an Envoy compiles and keeps for every filter that loads the module).
//! Lists that can be long (a shaper's due requests, the global keys, a
//! bulkhead's places) keep the standard sorts.

/// Sorts `v` so that no item is `less` than one before it; stable (equal
/// items keep their order). Quadratic: for short lists only.
pub fn small_by<T>(v: &mut [T], mut less: impl FnMut(&T, &T) -> bool) {
    for i in 1..v.len() {
        let mut j = i;
        while j > 0 {
            match (v.get(j - 1), v.get(j)) {
                (Some(a), Some(b)) if less(b, a) => v.swap(j - 1, j),
                _ => break,
            }
            j -= 1;
        }
    }
}

/// [`small_by`] on a key: ascending, stable.
pub fn small_by_key<T, K: Ord>(v: &mut [T], mut key: impl FnMut(&T) -> K) {
    small_by(v, |a, b| key(a) < key(b));
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn sorts_like_the_standard_stable_sort() {
        let mut seed = 7u64;
        for len in 0..40 {
            let mut v: Vec<(u8, usize)> = (0..len)
                .map(|i| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 60) as u8, i)
                })
                .collect();
            let mut want = v.clone();
            want.sort_by_key(|&(k, _)| k);
            small_by_key(&mut v, |&(k, _)| k);
            assert_eq!(v, want, "len {len}");
        }
    }

    #[test]
    fn a_comparison_that_is_not_an_order_still_ends() {
        let mut v = vec![3, 1, 2, 5, 4];
        small_by(&mut v, |_, _| true);
        assert_eq!(v.len(), 5);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![1, 2, 3, 4, 5]);
    }
}
