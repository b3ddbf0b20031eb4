-- Shared by every idem script. KEYS[1] is the record's hash; all state of a
-- scope lives in that one hash, so every script touches one slot.
--
-- Fields: tenant op key created fp state gen owner lease_until lease_ms
--         retention_ms updated expires status stored headers body completed
--         cur_id cur_start cur_end cur_outcome cur_status cur_late  (the
--         newest attempt) and hist (older attempts, JSON, touched only when
--         a record gets a second attempt or a fenced write arrives).
-- The hot paths call TIME, one HMGET and at most one HSET, plus one
-- PEXPIREAT when a new attempt starts (retention counts from there).

local record = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

-- Milliseconds since `at`, never negative: a clock that stepped back
-- (failover, NTP) must not make a record unreadable.
local function age(at)
  local elapsed = now - tonumber(at)
  if elapsed < 0 then
    return 0
  end
  return elapsed
end

-- Whether the record is live; deletes one that outlived its expiry.
local function live(state, expires)
  if not state then
    return false
  end
  if tonumber(expires) <= now then
    redis.call('DEL', record)
    return false
  end
  return true
end

-- Helpers for the rare paths (a fenced write, a duplicate, a second
-- attempt), built only when one is taken: creating closures on every call
-- would cost the hot paths.
local function rare()
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
    local id, gen, started, ended, kind, status, late = unpack(redis.call('HMGET', record,
      'cur_id', 'gen', 'cur_start', 'cur_end', 'cur_outcome', 'cur_status', 'cur_late'))
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

  -- What the record says now, for duplicates and fenced attempts.
  local function current(state)
    if not state or state == 'released' then
      return {'vacant'}
    end
    if state == 'cancelled' then
      return {'cancelled'}
    end
    if state == 'processing' then
      local left = tonumber(redis.call('HGET', record, 'lease_until')) - now
      if left < 0 then left = 0 end
      return {'processing', left}
    end
    local status, stored, headers, body, completed =
      unpack(redis.call('HMGET', record, 'status', 'stored', 'headers', 'body', 'completed'))
    return {'completed', tonumber(status), stored, headers, body, age(completed)}
  end

  -- Keeps a fenced write as late evidence on its attempt.
  local function keep_evidence(attempt_id, late)
    local cur = redis.call('HGET', record, 'cur_id')
    if not cur then
      return
    end
    if cur == attempt_id then
      redis.call('HSET', record, 'cur_late', late)
      return
    end
    local raw = redis.call('HGET', record, 'hist')
    if not raw or raw == '' then
      return
    end
    local hist = cjson.decode(raw)
    for i = 1, #hist do
      if hist[i].id == attempt_id then
        hist[i].late = late_table(late)
        redis.call('HSET', record, 'hist', cjson.encode(hist))
        return
      end
    end
  end
  return {
    late_table = late_table,
    current_attempt = current_attempt,
    current = current,
    keep_evidence = keep_evidence,
  }
end
