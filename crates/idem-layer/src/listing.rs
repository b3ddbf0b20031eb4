//! The budget of a layer's records listings: one at a time, and at most
//! a share of the time (see the [records module docs](crate::records)), so
//! a caller listing in a loop cannot take the store from every request.

use std::time::{Duration, Instant};

/// Listings take at most one part in this of the time…
const LISTING_SHARE: u32 = 20;

/// …beyond this much listing, which a layer that has not listed for a
/// while may spend at once.
const LISTING_ALLOWANCE: Duration = Duration::from_secs(1);

/// The listings of one layer: one at a time, within the share (see the
/// [records module docs](crate::records)). A virtual schedule: each listing moves `due` on by
/// `LISTING_SHARE` times its length; a listing may start while `due` is at
/// most the allowance's share ahead.
#[derive(Debug, Default)]
pub(crate) struct ListingBudget(std::sync::Mutex<Budget>);

#[derive(Debug, Default)]
struct Budget {
    running: bool,
    due: Option<Instant>,
}

impl ListingBudget {
    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        // The state is two plain values: a panic elsewhere leaves it usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a listing at `now`, or says how long until one may start.
    fn begin(&self, now: Instant) -> Result<(), Duration> {
        let mut budget = self.lock();
        if budget.running {
            return Err(Duration::from_secs(1));
        }
        let ahead = budget
            .due
            .map_or(Duration::ZERO, |due| due.saturating_duration_since(now));
        let allowed = LISTING_ALLOWANCE.saturating_mul(LISTING_SHARE);
        if ahead > allowed {
            return Err(ahead - allowed);
        }
        budget.running = true;
        Ok(())
    }

    /// Ends the listing that began at `started`, at `now`.
    fn end(&self, started: Instant, now: Instant) {
        let mut budget = self.lock();
        budget.running = false;
        let took = now.saturating_duration_since(started);
        let from = budget.due.map_or(started, |due| due.max(started));
        budget.due = Some(
            from.checked_add(took.saturating_mul(LISTING_SHARE))
                .unwrap_or(from),
        );
    }
}

/// A running listing: ends its budget's listing when dropped, also when
/// the request is abandoned halfway.
pub(crate) struct Listing<'a> {
    budget: &'a ListingBudget,
    started: Instant,
}

impl<'a> Listing<'a> {
    pub(crate) fn begin(budget: &'a ListingBudget) -> Result<Self, Duration> {
        let started = Instant::now();
        budget.begin(started)?;
        Ok(Self { budget, started })
    }
}

impl Drop for Listing<'_> {
    fn drop(&mut self) {
        self.budget.end(self.started, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One listing at a time; a listing may start while the schedule is at
    /// most a second's share ahead, and each moves it on by twenty times
    /// its length.
    #[test]
    fn listings_run_one_at_a_time_within_their_share() {
        let budget = ListingBudget::default();
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        let t0 = Instant::now();
        assert_eq!(budget.begin(t0), Ok(()));
        assert_eq!(budget.begin(t0), Err(s(1)), "a second listing at once");
        budget.end(t0, t0 + ms(500));
        // 10 s scheduled ahead, within the 20 s allowance.
        assert_eq!(budget.begin(t0 + ms(500)), Ok(()));
        budget.end(t0 + ms(500), t0 + ms(3500));
        // 70 s scheduled: the next may start at 50 s.
        assert_eq!(budget.begin(t0 + ms(3500)), Err(ms(46_500)));
        assert_eq!(budget.begin(t0 + s(49)), Err(s(1)));
        assert_eq!(budget.begin(t0 + s(50)), Ok(()));
        budget.end(t0 + s(50), t0 + s(50));
    }

    /// A caller listing in a loop, each listing taking a second, lists for
    /// a twentieth of the time (and the first second).
    #[test]
    fn listings_in_a_loop_take_a_twentieth_of_the_time() {
        let budget = ListingBudget::default();
        let t0 = Instant::now();
        let (mut now, mut listed) = (t0, Duration::ZERO);
        while now < t0 + Duration::from_secs(2000) {
            match budget.begin(now) {
                Ok(()) => {
                    let end = now + Duration::from_secs(1);
                    budget.end(now, end);
                    listed += Duration::from_secs(1);
                    now = end;
                }
                Err(wait) => now += wait,
            }
        }
        assert!(
            listed <= Duration::from_secs(2000 / 20 + 2),
            "listed {listed:?} of 2000 s"
        );
        assert!(listed >= Duration::from_secs(2000 / 20 - 2), "{listed:?}");
    }
}
