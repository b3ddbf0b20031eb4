//! A batch's events grouped by transaction, sent in waves: each
//! transaction's next event once its previous one was acknowledged.

use sqlx::Row;

/// An unpublished event as the batch's `SELECT` read it.
pub(super) struct Pending {
    pub(super) seq: i64,
    pub(super) id: String,
    pub(super) subject: String,
    pub(super) payload: Vec<u8>,
}

/// A batch's events by transaction (the id without its position), each
/// transaction's in `seq` order. A transaction that stopped is emptied.
pub(super) struct Waves {
    groups: Vec<std::collections::VecDeque<Pending>>,
}

impl Waves {
    pub(super) fn of(rows: Vec<sqlx::postgres::PgRow>) -> Result<Self, sqlx::Error> {
        let mut index: std::collections::HashMap<String, usize> = Default::default();
        let mut groups: Vec<std::collections::VecDeque<Pending>> = Vec::new();
        for row in rows {
            let event = Pending {
                seq: row.try_get("seq")?,
                id: row.try_get("id")?,
                subject: row.try_get("subject")?,
                payload: row.try_get("payload")?,
            };
            let transaction = event
                .id
                .rsplit_once('-')
                .map_or(event.id.as_str(), |(head, _)| head);
            let at = *index.entry(transaction.to_owned()).or_insert_with(|| {
                groups.push(Default::default());
                groups.len() - 1
            });
            groups[at].push_back(event);
        }
        Ok(Self { groups })
    }

    /// The next event of every transaction that has one, with its group.
    pub(super) fn next_wave(&mut self) -> Option<Vec<(usize, Pending)>> {
        let wave: Vec<_> = self
            .groups
            .iter_mut()
            .enumerate()
            .filter_map(|(group, events)| Some((group, events.pop_front()?)))
            .collect();
        (!wave.is_empty()).then_some(wave)
    }

    /// The transaction `group` sends nothing more in this batch.
    pub(super) fn stop(&mut self, group: usize) {
        self.groups[group].clear();
    }
}
