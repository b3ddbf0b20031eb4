-- ARGV: fingerprint, attempt id, owner token, lease ms, retention ms,
--       tenant, operation, key
-- Answers the integer 1 for a new key (acquired, generation 1), one
-- string for a replay, else a table led by its kind: acquired, taken_over,
-- in_progress, conflict, cancelled (decode_reservation in lib.rs).
-- The tenant's field, 'tenant' or 'tenant_bin' (see decode.rs), is filled
-- in by scripts.rs: one script for each.
local TENANT_FIELD = @TENANT_FIELD@
local fp = ARGV[1]
-- A new key needs only the state (absent): a record Redis hands a script
-- is live (see head.lua). The other fields are read where they are needed.
local state = redis.call('HGET', record, @state@)

if state == 'completed' then
  -- A hot path, the replay: only the fields it answers with, and
  -- no clock (the record is live, see head.lua; its client measures the
  -- age from the completion time). done is '<status>:<stored>:<ended>',
  -- a packed record's d.
  -- The record's expiry goes with it (a process may keep the replay that
  -- long): a packed record's n (its start plus retention), else expires.
  local found_fp, done, headers, body, split, version, n, expires, cur_id
  if PACKED then
    found_fp, done, headers, body, split, version, n, cur_id = unpack(redis.call('HMGET',
      record, @fp@, @d@, @headers@, @body@, @split@, @v@, @n@, @cur_id@))
  end
  if not done then
    local status, stored, ended
    found_fp, status, stored, headers, body, ended, split, version, expires, cur_id = unpack(
      redis.call('HMGET', record, @fp@, @status@, @stored@, @headers@, @body@, @cur_end@,
        @split@, @v@, @expires@, @cur_id@))
    if status then
      done = status .. ':' .. stored .. ':' .. ended
    else
      -- A packed record, on a store that does not pack.
      done, n = unpack(redis.call('HMGET', record, @d@, @n@))
    end
  end
  -- A packed record's n as it is, led by 'p' (decode.rs adds its start
  -- and retention: cheaper there than in Lua).
  -- Then the attempt whose outcome it is (sealed responses are bound to
  -- it; empty when the record does not name one).
  done = (done or '') .. ':' .. (n and ('p' .. n) or expires or '0') .. ':' .. (cur_id or '')
  if version and tonumber(version) > NEWEST then
    -- A newer format (see common.lua).
    return redis.error_reply('idem: record format ' .. version ..
      ' is newer than this store reads (' .. NEWEST .. '); upgrade every instance')
  end
  if found_fp ~= fp then
    return {'conflict'}
  end
  -- One string, not a table (see the new key's answer below):
  -- '<done>:<expires, or n led by p>:<attempt id>:<length of the headers>:'
  -- then the headers and the body.
  if split then
    -- The response is kept in a key of its own (see complete.lua), its
    -- headers and body already one string.
    local raw = redis.call('GET', record .. ':r')
    if raw then
      return done .. ':' .. split .. ':' .. raw
    end
    -- The response's key is gone (evicted, deleted): never replayed as if
    -- whole. The stored flag '2' says so (decode.rs).
    return string.gsub(done, '^(%d*):%d*:', '%1:2:', 1) .. ':0:'
  end
  headers, body = headers or '', body or ''
  return done .. ':' .. string.format('%d', #headers) .. ':' .. headers .. body
end

--@clock
if not state then
  -- The other hot path, a new key. One HSET with literal fields, no
  -- tables, no helpers, and the integer 1 for its answer (acquired,
  -- generation 1): a table costs Redis about 5,000 instructions to build
  -- and encode, an integer next to nothing. Text, not numbers: a Lua number handed to
  -- redis.call is converted by Redis itself, several times slower than
  -- string.format.
  -- The fields the hot paths read come first: Redis finds a field of a
  -- compact hash by scanning it from the start.
  if PACKED then
    redis.call('HSET', record, @state@, 'processing',
      @n@, string.format('%d:%s:%s', now, ARGV[4], ARGV[5]),
      @owner@, ARGV[3], @fp@, fp, @cur_id@, ARGV[2], TENANT_FIELD, ARGV[6], @op@, ARGV[7],
      @key@, ARGV[8], @v@, FORMAT)
    -- The retention from Redis' time of this script, which TIME read
    -- (within the millisecond): the key expires with the expiry n implies.
    redis.call('PEXPIRE', record, ARGV[5])
    return 1
  end
  local expires = string.format('%d', now + tonumber(ARGV[5]))
  redis.call('HSET', record, @state@, 'processing', @gen@, '1', @owner@, ARGV[3], @fp@, fp,
    @expires@, expires, @lease_until@, string.format('%d', now + tonumber(ARGV[4])),
    @cur_id@, ARGV[2], @cur_start@, string.format('%d', now), @cur_outcome@, 'running',
    @lease_ms@, ARGV[4], @retention_ms@, ARGV[5], TENANT_FIELD, ARGV[6], @op@, ARGV[7],
    @key@, ARGV[8])
  redis.call('PEXPIREAT', record, expires)
  return 1
end

--@common

local attempt_id, token = ARGV[2], ARGV[3]
local lease_ms, retention_ms = tonumber(ARGV[4]), tonumber(ARGV[5])

-- Starts attempt `gen`; `extra` holds more field/value pairs to set.
local function start(gen, extra)
  local expires, now_text = ms(now + retention_ms), ms(now)
  -- Until now the record's creation was its first attempt's start.
  local created, started = unpack(redis.call('HMGET', record, @created@, @cur_start@))
  local fields = {@fp@, fp, @state@, 'processing', @gen@, ms(gen), @owner@, token,
    @lease_until@, ms(now + lease_ms), @lease_ms@, ARGV[4], @retention_ms@, ARGV[5],
    @cur_id@, attempt_id, @cur_start@, now_text, @cur_end@, '', @cur_outcome@, 'running',
    @cur_late@, '', @expires@, expires, @created@, created or started or now_text}
  for i = 1, #extra do
    fields[#fields + 1] = extra[i]
  end
  if FORMAT ~= '' then
    fields[#fields + 1] = @v@
    fields[#fields + 1] = FORMAT
  end
  redis.call('HSET', record, unpack(fields))
  redis.call('PEXPIREAT', record, expires)
  return gen
end

-- Moves the newest attempt into the history before a new one starts.
local function archive()
  local attempt = rare().current_attempt()
  local raw = redis.call('HGET', record, @hist@)
  local hist = {}
  if raw and raw ~= '' then
    hist = cjson.decode(raw)
  end
  table.insert(hist, attempt)
  while #hist > HISTORY - 1 do
    -- The oldest goes, but never the newest attempt of unknown outcome
    -- (superseded while it ran): it binds the key to its request
    -- (machine.rs, push_attempt).
    if rare().superseded_at(hist) == 1 then
      table.remove(hist, 2)
    else
      table.remove(hist, 1)
    end
  end
  local encoded = ''
  if #hist > 0 then
    encoded = cjson.encode(hist)
  end
  return attempt, {@hist@, encoded}
end

expand()
local found_fp, found_gen, lease_until, cur_id, owner, expires_at, cur_outcome = unpack(
  redis.call('HMGET', record, @fp@, @gen@, @lease_until@, @cur_id@, @owner@, @expires@,
    @cur_outcome@))
if not live(state, expires_at) then
  -- A key that outlived its expires field (the two are set together, so
  -- only a clock that jumped gets here): gone, and the key is new.
  return {'acquired', start(1, {TENANT_FIELD, ARGV[6], @op@, ARGV[7], @key@, ARGV[8]})}
end
local gen = tonumber(found_gen)
if state == 'released' then
  local _, hist = archive()
  return {'acquired', start(gen + 1, hist)}
end
if found_fp ~= fp then
  return {'conflict'}
end
if state == 'processing' then
  if cur_id == attempt_id and owner == token then
    -- A retry of this very reservation whose reply was lost: answer as the
    -- first call did, a takeover when it superseded an attempt.
    local superseded = rare().superseded_by(gen)
    if superseded then
      return {'taken_over', gen, cjson.encode(superseded)}
    end
    return {'acquired', gen}
  end
  local lease_left = tonumber(lease_until) - now
  if lease_left <= 0 and owner and owner ~= '' then
    -- After a restart of this server (its uptime, per shard), a lease
    -- runs until at least a lease after the start (machine.rs,
    -- lease_after_start): an owner that held an outcome, or kept running,
    -- while Redis was down records it, or renews, before anyone takes
    -- over. Uptime comes in whole seconds: the start is taken as early as
    -- it can have been, so no lease runs past a lease after the real
    -- start (the owner has at least the lease less a second).
    local uptime = string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')
    local started = now - (tonumber(uptime or '0') + 1) * 1000
    lease_left = started + tonumber(redis.call('HGET', record, @lease_ms@) or '0') - now
  end
  if lease_left > 0 then
    return {'in_progress', lease_left}
  end
  -- A running attempt is superseded. One a release already ended (see
  -- release.lua) is archived as it ended, and the attempt of unknown
  -- outcome reported is the newest one superseded before it.
  local newest
  if cur_outcome == 'released' then
    newest = rare().newest_superseded()
  else
    redis.call('HSET', record, @cur_outcome@, 'superseded', @cur_end@, now)
  end
  local superseded, hist = archive()
  superseded = newest or superseded
  return {'taken_over', start(gen + 1, hist), cjson.encode(superseded)}
end
return {'cancelled'}
