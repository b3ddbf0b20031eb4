-- Counts the lapsed records of one SCAN page inside Redis (the gateway's
-- idem_records_lapsed): live records processing past their lease, by
-- Redis' clock, as a listing with `lapsed` finds them (get.lua and
-- RecordQuery::matches), without handing a record out.
-- ARGV: the SCAN cursor, the record keys' pattern ('<prefix>{*}'), the
--       page's COUNT, the length of a record key ('<prefix>{<64 hex>}').
-- Answers {the next cursor, how many of the page's records lapsed}.
-- No KEYS: the keys come from SCAN (a single node only; a cluster lists).
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local page = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local key_length = tonumber(ARGV[4])
local lapsed = 0
for _, key in ipairs(page[2]) do
  if #key == key_length then
    -- pcall: a key of another type that fits the pattern is skipped, but
    -- for a string record.
    local fields = redis.pcall('HMGET', key, @state@, @lease_until@, @expires@, @n@)
    if type(fields) == 'table' and fields.err then
      -- A record kept as one string (format 3, string_record.rs): its
      -- reservation began retention - PTTL ago by Redis' clock, or at the
      -- start it carries, whichever is later (string_record.lua: an
      -- expiry changed from outside never shortens a live lease).
      local raw = redis.pcall('GET', key)
      local head = type(raw) == 'string' and string.sub(raw, @S_VERSION_AT@, @S_STATE_AT@)
      if head == @S_HEAD_PROCESSING@ or head == @S_HEAD_WATCHED@ then
        local carried, lease_ms, retention_ms = string.match(raw, '^(%d+):(%d+):(%d+):', @S_VARIABLE_AT@)
        local pttl = redis.call('PTTL', key)
        if lease_ms and pttl > 0 then
          local started = math.max(now + pttl - tonumber(retention_ms), tonumber(carried))
          if now >= started + tonumber(lease_ms) then
            lapsed = lapsed + 1
          end
        end
      end
    elseif type(fields) == 'table' and fields[1] == 'processing' then
      -- Missing fields read as 0, as decode.rs reads them.
      local lease_until, expires = tonumber(fields[2]) or 0, tonumber(fields[3]) or 0
      if fields[4] then
        -- A packed record (see head.lua): n is 'cur_start:lease_ms:retention_ms'.
        local started, lease_ms, retention_ms = string.match(fields[4], '^(%d+):(%d+):(%d+)$')
        if started then
          lease_until = tonumber(started) + tonumber(lease_ms)
          expires = tonumber(started) + tonumber(retention_ms)
        end
      end
      if lease_until <= now and expires > now then
        lapsed = lapsed + 1
      end
    end
  end
end
return {page[1], lapsed}
