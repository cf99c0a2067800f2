//! [`Small`]: a list whose first few items live inline, for the lists a
//! request's path builds and drops (a request's rule reports): most
//! requests match a rule or two, and need no heap allocation for them.

use std::ops::{Deref, DerefMut};

/// A list of at most `N` items inline; more move it to the heap.
#[derive(Clone)]
pub struct Small<T, const N: usize> {
    len: usize,
    inline: [T; N],
    /// Every item, once there are more than `N` (then `inline` is unused).
    spill: Vec<T>,
}

impl<T: Default, const N: usize> Default for Small<T, N> {
    fn default() -> Self {
        Small {
            len: 0,
            inline: std::array::from_fn(|_| T::default()),
            spill: Vec::new(),
        }
    }
}

impl<T: Default, const N: usize> Small<T, N> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, v: T) {
        if self.spill.is_empty() {
            if let Some(slot) = self.inline.get_mut(self.len) {
                *slot = v;
                self.len += 1;
                return;
            }
            let inline = self.inline.get_mut(..self.len).unwrap_or_default();
            self.spill.reserve(inline.len() + 1);
            self.spill.extend(inline.iter_mut().map(std::mem::take));
        }
        self.spill.push(v);
        self.len += 1;
    }

    /// Removes and returns item `i`, shifting the later ones down.
    pub fn remove(&mut self, i: usize) -> Option<T> {
        if i >= self.len {
            return None;
        }
        self.len -= 1;
        if !self.spill.is_empty() {
            return Some(self.spill.remove(i));
        }
        let tail = self.inline.get_mut(i..=self.len)?;
        let v = tail.first_mut().map(std::mem::take);
        tail.rotate_left(1);
        v
    }
}

impl<T, const N: usize> Small<T, N> {
    /// Keeps the items `keep` approves of, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        if !self.spill.is_empty() {
            self.spill.retain(keep);
            self.len = self.spill.len();
            return;
        }
        let mut kept = 0;
        for i in 0..self.len {
            if self.inline.get(i).is_some_and(&mut keep) {
                self.inline.swap(kept, i);
                kept += 1;
            }
        }
        self.len = kept;
    }
}

impl<T, const N: usize> IntoIterator for Small<T, N> {
    type Item = T;
    type IntoIter =
        std::iter::Chain<std::iter::Take<std::array::IntoIter<T, N>>, std::vec::IntoIter<T>>;

    fn into_iter(self) -> Self::IntoIter {
        let inline = if self.spill.is_empty() { self.len } else { 0 };
        self.inline.into_iter().take(inline).chain(self.spill)
    }
}

impl<T: Default, const N: usize> Extend<T> for Small<T, N> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, items: I) {
        for v in items {
            self.push(v);
        }
    }
}

impl<T: Default, const N: usize> From<Vec<T>> for Small<T, N> {
    fn from(v: Vec<T>) -> Self {
        let mut s = Small::new();
        s.extend(v);
        s
    }
}

impl<T, const N: usize> Deref for Small<T, N> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        if self.spill.is_empty() {
            self.inline.get(..self.len).unwrap_or_default()
        } else {
            &self.spill
        }
    }
}

impl<T, const N: usize> DerefMut for Small<T, N> {
    fn deref_mut(&mut self) -> &mut [T] {
        if self.spill.is_empty() {
            self.inline.get_mut(..self.len).unwrap_or_default()
        } else {
            &mut self.spill
        }
    }
}

impl<'a, T, const N: usize> IntoIterator for &'a Small<T, N> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: std::fmt::Debug, const N: usize> std::fmt::Debug for Small<T, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq, const N: usize> PartialEq for Small<T, N> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Eq, const N: usize> Eq for Small<T, N> {}

impl<T: PartialEq, const N: usize> PartialEq<Vec<T>> for Small<T, N> {
    fn eq(&self, other: &Vec<T>) -> bool {
        **self == **other
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn behaves_as_a_vec_inline_and_spilled() {
        let mut rng = crate::rng::SplitMix(3);
        for _ in 0..500 {
            let mut s: Small<u32, 2> = Small::new();
            let mut v = Vec::new();
            for _ in 0..rng.below(8) {
                if rng.below(3) == 0 && !v.is_empty() {
                    let i = rng.below(v.len() as u64 + 1) as usize;
                    let expected = (i < v.len()).then(|| v.remove(i));
                    assert_eq!(s.remove(i), expected);
                } else {
                    let x = rng.below(100) as u32;
                    s.push(x);
                    v.push(x);
                }
                assert_eq!(&*s, &v[..]);
            }
            s.sort_unstable();
            v.sort_unstable();
            assert_eq!(&*s, &v[..]);
            let odd = |x: &u32| x % 2 == 1;
            s.retain(odd);
            v.retain(odd);
            assert_eq!(&*s, &v[..]);
            assert_eq!(s.clone().into_iter().collect::<Vec<_>>(), v);
            s.push(5);
            v.push(5);
            assert_eq!(s.into_iter().collect::<Vec<_>>(), v);
        }
    }
}
