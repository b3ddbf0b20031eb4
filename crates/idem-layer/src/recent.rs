//! A thread's few recent answers, kept so that the same question asked
//! again (the same caller's credential, the same route) is not worked
//! out again for every request.

/// At most `N` items, the oldest replaced first.
pub(crate) struct Recent<T, const N: usize> {
    items: [Option<T>; N],
    next: usize,
}

impl<T, const N: usize> Recent<T, N> {
    /// None kept yet.
    pub(crate) const fn new() -> Self {
        Self {
            items: [const { None }; N],
            next: 0,
        }
    }

    /// The items kept, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter().flatten()
    }

    /// Keeps `item`, in place of the oldest when all `N` places are taken.
    pub(crate) fn push(&mut self, item: T) {
        self.items[self.next] = Some(item);
        self.next = (self.next + 1) % N;
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    /// The last `N` items pushed are kept, and only they.
    #[test]
    fn the_last_n_items_are_kept() {
        let mut recent = Recent::<u32, 3>::new();
        assert_eq!(recent.iter().count(), 0);
        for item in 0..7 {
            recent.push(item);
            let mut kept: Vec<u32> = recent.iter().copied().collect();
            kept.sort_unstable();
            let expected: Vec<u32> = (item.saturating_sub(2)..=item).collect();
            assert_eq!(kept, expected, "after {item}");
        }
    }
}
