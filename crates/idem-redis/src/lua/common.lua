-- Shared by every idem script. KEYS[1] is the record's hash; all state of a
-- scope lives in that one hash, so every script touches one slot.
--
-- Fields: tenant op key fp state gen owner lease_until lease_ms retention_ms
--         created updated completed expires status stored headers body attempts

local record = KEYS[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local now = now_ms()

-- The live record's state, or nil. An expired record is deleted here even
-- if Redis has not yet expired the key.
local function live_state()
  local state, expires = unpack(redis.call('HMGET', record, 'state', 'expires'))
  if not state then
    return nil
  end
  if tonumber(expires) <= now then
    redis.call('DEL', record)
    return nil
  end
  return state
end

local function set_expiry(retention_ms)
  local expires = now + retention_ms
  redis.call('HSET', record, 'expires', expires, 'updated', now)
  redis.call('PEXPIREAT', record, expires)
end

local function load_attempts()
  local raw = redis.call('HGET', record, 'attempts')
  if not raw then
    return {}
  end
  return cjson.decode(raw)
end

local function save_attempts(attempts)
  redis.call('HSET', record, 'attempts', cjson.encode(attempts))
end

-- Ends the running attempt of the current generation with `outcome`.
local function end_current(attempts, outcome)
  local gen = tonumber(redis.call('HGET', record, 'gen'))
  for i = #attempts, 1, -1 do
    local a = attempts[i]
    if a.generation == gen and a.outcome.kind == 'running' then
      a.outcome = outcome
      a.ended_at_ms = now
      return a
    end
  end
  return nil
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
    local lease_until = tonumber(redis.call('HGET', record, 'lease_until'))
    local left = lease_until - now
    if left < 0 then left = 0 end
    return {'processing', left}
  end
  local status, stored, headers, body, completed =
    unpack(redis.call('HMGET', record, 'status', 'stored', 'headers', 'body', 'completed'))
  return {'completed', tonumber(status), stored, headers, body, now - tonumber(completed)}
end

-- Whether the lease (generation, owner token) is still the record's.
local function owns(state, gen, token)
  if state ~= 'processing' then
    return false
  end
  local cur_gen, owner = unpack(redis.call('HMGET', record, 'gen', 'owner'))
  return cur_gen == gen and owner == token
end

-- Keeps a fenced write as late evidence on its attempt.
local function keep_evidence(attempt_id, late)
  if redis.call('HEXISTS', record, 'attempts') == 0 then
    return
  end
  local attempts = load_attempts()
  for i = 1, #attempts do
    if attempts[i].id == attempt_id then
      attempts[i].late = late
      save_attempts(attempts)
      return
    end
  end
end
