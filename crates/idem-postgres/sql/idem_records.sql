-- The idempotency records of idem-postgres. `PgStore::migrate()` runs this
-- same text (with the configured table name); apply it yourself if your
-- migrations are managed elsewhere.
--
-- Times are milliseconds since the Unix epoch on the database's clock
-- (clock_timestamp()), never the application's.
CREATE TABLE IF NOT EXISTS idem_records (
    scope               bytea PRIMARY KEY,  -- SHA-256 or HMAC-SHA256 of tenant, operation and key
    tenant              text NOT NULL,
    operation           text NOT NULL,
    key                 text NOT NULL,
    fingerprint         bytea NOT NULL,
    state               text NOT NULL,      -- processing, completed, cancelled, released
    generation          bigint NOT NULL,
    owner               uuid,               -- the lease owner's token while processing
    lease_ms            bigint NOT NULL,
    retention_ms        bigint NOT NULL,
    lease_expires_at_ms bigint NOT NULL,
    created_at_ms       bigint NOT NULL,
    updated_at_ms       bigint NOT NULL,
    completed_at_ms     bigint,
    expires_at_ms       bigint NOT NULL,
    status              integer,            -- completed: the response status
    stored              boolean,            -- completed: whether the response is replayable
    header_names        text[],
    header_values       bytea[],
    body                bytea,
    attempts            jsonb NOT NULL      -- newest 8 attempts, oldest first (the newest superseded one always kept)
);

-- The sweep deletes expired records in expiry order.
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at_ms);

-- Which identity the instances sharing the table have (how they derive
-- tenants and scopes): one row, claimed through `PgStore::claim_identity`.
CREATE TABLE IF NOT EXISTS idem_records_identity (
    id            boolean PRIMARY KEY DEFAULT true CHECK (id),
    marker        text NOT NULL,
    expires_at_ms bigint NOT NULL
);

-- Who does each fleet-wide chore (the gateway's count of lapsed records),
-- and until when: claimed through `PgStore::claim_duty`.
CREATE TABLE IF NOT EXISTS idem_records_duties (
    name          text PRIMARY KEY,
    holder        text NOT NULL,
    expires_at_ms bigint NOT NULL
);
