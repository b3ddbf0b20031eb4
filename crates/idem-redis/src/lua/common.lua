-- The helpers shared by the scripts (after head.lua). A script's hot path
-- runs before them where it can (see scripts.rs: the `--@common` line of a
-- script is where they go): each `local function` is a closure built on
-- every call that reaches its definition, about 600 instructions apiece.

local response_key = record .. ':r'

-- A record of a newer format than this store reads (format.rs) is
-- refused, never misread or changed: every path past the hot ones gets
-- here first (a replay checks on its own).
-- (A record kept as one string, format 3, answers WRONGTYPE: get.lua
-- reads it as it is, the other scripts have it converted, invocation.rs.)
local version = redis.pcall('HGET', record, @v@)
if type(version) == 'table' then
  version = nil
end
if version and tonumber(version) > NEWEST then
  return redis.error_reply('idem: record format ' .. version ..
    ' is newer than this store reads (' .. NEWEST .. '); upgrade every instance')
end

-- An integer (milliseconds, a length) as the text Redis keeps. A Lua
-- number handed to redis.call is converted by Redis itself, several times
-- slower than string.format (about 0.4 µs a number): hot paths pass text.
local function ms(value)
  return string.format('%d', value)
end

-- The fields of a packed record (see head.lua) as HSET pairs of the
-- expanded layout, from its n, d and state.
local function unpacked(n, d, state)
  local started, lease_ms, retention_ms = string.match(n, '^(%d+):(%d+):(%d+)$')
  local outcome = 'running'
  if state == 'completed' or state == 'released' then
    outcome = state
  end
  local start = tonumber(started)
  local fields = {@gen@, '1', @expires@, ms(start + tonumber(retention_ms)),
    @lease_until@, ms(start + tonumber(lease_ms)), @cur_start@, started,
    @lease_ms@, lease_ms, @retention_ms@, retention_ms, @cur_outcome@, outcome}
  if d then
    local status, stored, ended = string.match(d, '^(%d*):(%d*):(%d+)$')
    if status ~= '' then
      table.insert(fields, @status@)
      table.insert(fields, status)
      table.insert(fields, @stored@)
      table.insert(fields, stored)
    end
    table.insert(fields, @cur_end@)
    table.insert(fields, ended)
  end
  return fields
end

-- Rewrites a packed record (its n given, or read when nil) in the
-- expanded layout, which every path but the hot ones works on; a record
-- already expanded is left as it is.
local function expand(n)
  n = n or redis.call('HGET', record, @n@)
  if not n then
    return
  end
  local d, state = unpack(redis.call('HMGET', record, @d@, @state@))
  redis.call('HSET', record, unpack(unpacked(n, d, state)))
  redis.call('HDEL', record, @n@, @d@)
end

-- Whether the record is live; deletes one that outlived its expiry.
local function live(state, expires)
  if not state then
    return false
  end
  if tonumber(expires) <= now then
    redis.call('DEL', record, response_key)
    return false
  end
  return true
end

-- The stored response's headers and body: inline, or from the response
-- key when `split` says it is there.
local function response(headers, body, split)
  if not split then
    return headers, body
  end
  local raw = redis.call('GET', response_key) or ''
  local n = tonumber(split)
  return string.sub(raw, 1, n), string.sub(raw, n + 1)
end

-- Helpers for the rare paths (a fenced write, a duplicate, a second
-- attempt), built only when one is taken: creating closures on every call
-- would cost the hot paths.
local function rare()
  -- The record as HGETALL pairs, the response included as headers and body
  -- wherever it is kept.
  -- A packed record's fields are given expanded as well (get reads
  -- without writing).
  local function all_fields()
    local fields = redis.call('HGETALL', record)
    local split, n, d, state
    for i = 1, #fields, 2 do
      local name = fields[i]
      if name == @split@ then
        split = fields[i + 1]
      elseif name == @n@ then
        n = fields[i + 1]
      elseif name == @d@ then
        d = fields[i + 1]
      elseif name == @state@ then
        state = fields[i + 1]
      end
    end
    if split then
      local headers, body = response(nil, nil, split)
      table.insert(fields, @headers@)
      table.insert(fields, headers)
      table.insert(fields, @body@)
      table.insert(fields, body)
    end
    if n then
      for _, value in ipairs(unpacked(n, d, state)) do
        table.insert(fields, value)
      end
    end
    return fields
  end

  -- Wakes the record's waiting duplicates (see watch.rs) on a store that
  -- publishes: cancel, abandon and force release. Complete and release
  -- publish on their hot paths, and only for a record a waiter marked
  -- (field w, see watch.lua).
  local function notify()
    if NOTIFY then
      redis.call('PUBLISH', record .. ':c', '1')
    end
  end

  -- 'completed:201:1700000000000' or 'released::1700000000000' as a table.
  local function late_table(late)
    if not late or late == '' then
      return cjson.null
    end
    local kind, status, at = string.match(late, '^(%a+):(%d*):(%d+)$')
    if kind == 'completed' then
      return {kind = kind, status = tonumber(status), at_ms = tonumber(at)}
    end
    return {kind = kind, at_ms = tonumber(at)}
  end

  -- The newest attempt in the JSON form of idem_core::Attempt.
  local function current_attempt()
    local id, gen, started, ended, kind, late, status = unpack(redis.call(
      'HMGET', record, @cur_id@, @gen@, @cur_start@, @cur_end@, @cur_outcome@, @cur_late@,
      @status@))
    local outcome = {kind = kind}
    if kind == 'completed' then
      outcome.status = tonumber(status)
    end
    local ended_at = cjson.null
    if ended and ended ~= '' then
      ended_at = tonumber(ended)
    end
    return {
      id = id, generation = tonumber(gen), started_at_ms = tonumber(started),
      ended_at_ms = ended_at, outcome = outcome, late = late_table(late),
    }
  end

  -- What the record says now, for duplicates and fenced attempts. A
  -- completed record is {'completed', '<status>:<stored>:<completed at>',
  -- headers, body, attempt id}: five elements, each of which the client
  -- parses.
  local function current(state)
    if not state or state == 'released' then
      return {'vacant'}
    end
    if state == 'cancelled' then
      return {'cancelled'}
    end
    if state == 'processing' then
      local left = tonumber(redis.call('HGET', record, @lease_until@)) - now
      if left < 0 then left = 0 end
      return {'processing', left}
    end
    local status, stored, headers, body, ended, split, cur_id = unpack(redis.call('HMGET',
      record, @status@, @stored@, @headers@, @body@, @cur_end@, @split@, @cur_id@))
    if split and redis.call('EXISTS', response_key) == 0 then
      -- The response's key is gone: the stored flag '2' says so.
      stored = '2'
    end
    headers, body = response(headers, body, split)
    return {'completed', status .. ':' .. stored .. ':' .. ended, headers, body, cur_id or ''}
  end

  -- Keeps a fenced write as late evidence on its attempt.
  local function keep_evidence(attempt_id, late)
    local cur = redis.call('HGET', record, @cur_id@)
    if not cur then
      return
    end
    if cur == attempt_id then
      redis.call('HSET', record, @cur_late@, late)
      return
    end
    local raw = redis.call('HGET', record, @hist@)
    if not raw or raw == '' then
      return
    end
    local hist = cjson.decode(raw)
    for i = 1, #hist do
      if hist[i].id == attempt_id then
        hist[i].late = late_table(late)
        redis.call('HSET', record, @hist@, cjson.encode(hist))
        return
      end
    end
  end
  -- Where in a decoded history the newest attempt superseded while it
  -- ran is (its outcome unknown: it may have acted), or nil. The history
  -- keeps it whatever else it drops (reserve.lua's archive).
  local function superseded_at(hist)
    for i = #hist, 1, -1 do
      if hist[i].outcome and hist[i].outcome.kind == 'superseded' then
        return i
      end
    end
    return nil
  end
  -- The newest older attempt superseded while it ran, or nil.
  local function newest_superseded()
    local raw = redis.call('HGET', record, @hist@)
    if not raw or raw == '' then
      return nil
    end
    local hist = cjson.decode(raw)
    local at = superseded_at(hist)
    return at and hist[at]
  end
  -- Ends the current attempt as released at `ended` (a later attempt's
  -- release, a given-up reservation): with an attempt of unknown outcome
  -- in the history the key is freed for the same request only (the
  -- record stays processing, its lease lapsed and held by nobody, so the
  -- same request takes it over at once and a changed one conflicts), else
  -- released (machine::release likewise).
  local function release_current(ended)
    if newest_superseded() then
      redis.call('HSET', record, @owner@, '', @lease_until@, ms(now), @cur_end@, ended,
        @cur_outcome@, 'released')
    else
      redis.call('HSET', record, @state@, 'released', @owner@, '', @cur_end@, ended,
        @cur_outcome@, 'released')
    end
  end
  -- The attempt that the current one (generation `gen`) took over, from
  -- the history, or nil when the current one did not take over: the
  -- newest superseded attempt, if it is the one just before.
  local function superseded_by(gen)
    if not gen or gen <= 1 then
      return nil
    end
    local newest = newest_superseded()
    if newest and newest.generation == gen - 1 then
      return newest
    end
    return nil
  end
  return {
    superseded_at = superseded_at,
    newest_superseded = newest_superseded,
    release_current = release_current,
    superseded_by = superseded_by,
    late_table = late_table,
    current_attempt = current_attempt,
    current = current,
    keep_evidence = keep_evidence,
    all_fields = all_fields,
    notify = notify,
  }
end
