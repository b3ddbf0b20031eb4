-- Rewrites a record kept as one string (record format 3, see
-- string_record.rs) as the packed format 2 hash it stands for (head.lua),
-- with the same expiry, so that the format 2 scripts can work on it. Runs
-- without the shared prologue, after string_record.lua, when a script met
-- the string with WRONGTYPE (invocation.rs), and changes nothing a reader
-- could tell apart: the record's state, owner, attempt, fingerprint,
-- request and response stay as they were.
-- Answers 1 when it rewrote the record, 0 when KEYS[1] holds no string
-- (gone meanwhile, or already a hash).
local record = KEYS[1]
local raw = redis.pcall('GET', record)
if type(raw) ~= 'string' then
  return 0
end
local expires_at = redis.call('PEXPIRETIME', record)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local fields, headers, body = string_fields(raw, expires_at, now)
if not fields then
  return headers
end
local response_key = record .. ':r'
if headers then
  if #headers <= 64 and #body <= 64 then
    table.insert(fields, @headers@)
    table.insert(fields, headers)
    table.insert(fields, @body@)
    table.insert(fields, body)
  else
    -- As complete.lua keeps a response too long for the compact encoding.
    if expires_at >= 0 then
      redis.call('SET', response_key, headers .. body, 'PXAT', string.format('%d', expires_at))
    else
      redis.call('SET', response_key, headers .. body)
    end
    table.insert(fields, @split@)
    table.insert(fields, string.format('%d', #headers))
  end
end
redis.call('DEL', record)
redis.call('HSET', record, unpack(fields))
if expires_at >= 0 then
  -- The expiry as it was.
  redis.call('PEXPIREAT', record, string.format('%d', expires_at))
end
return 1
