-- Rewrites a record kept as one string (record format 3, see
-- string_record.rs) as the packed format 2 hash it stands for (head.lua),
-- with the same expiry, so that the format 2 scripts can work on it. Runs
-- without the shared prologue, when a script met the string with
-- WRONGTYPE (invocation.rs), and changes nothing a reader could tell
-- apart: the record's state, owner, attempt, fingerprint, request and
-- response stay as they were.
-- Answers 1 when it rewrote the record, 0 when KEYS[1] holds no string
-- record (gone meanwhile, or already a hash).
local record = KEYS[1]
local raw = redis.pcall('GET', record)
if type(raw) ~= 'string' then
  return 0
end
local version = string.sub(raw, 1, 1)
if version ~= '3' then
  if string.match(version, '^%d$') and tonumber(version) > 3 then
    return redis.error_reply('idem: record format ' .. version ..
      ' is newer than this store reads (3); upgrade every instance')
  end
  return 0
end
local function corrupt()
  return redis.error_reply('idem: a string record that does not parse')
end
local kind = string.sub(raw, 2, 2)
local _, at, lease_ms, retention_ms, form, length =
  string.find(raw, '^%d+:(%d+):(%d+):([tb])(%d+):', 139)
if not at or (kind ~= 'p' and kind ~= 'a' and kind ~= 'c') then
  return corrupt()
end
-- A field led by its length, from `from`; and where the next begins.
local function field(from, length)
  return string.sub(raw, from, from + length - 1), from + length
end
local tenant, op, key
tenant, at = field(at + 1, tonumber(length))
local _, ended = string.find(raw, '^%d+:', at)
if not ended then return corrupt() end
op, at = field(ended + 1, tonumber(string.sub(raw, at, ended - 1)))
_, ended = string.find(raw, '^%d+:', at)
if not ended then return corrupt() end
key, at = field(ended + 1, tonumber(string.sub(raw, at, ended - 1)))

-- The reservation began retention - PTTL ago by Redis' clock: the hash's
-- start, from which its lease and expiry follow (head.lua).
local pttl = redis.call('PTTL', record)
local retention = tonumber(retention_ms)
if pttl < 0 or pttl > retention then
  pttl = retention
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local fields = {@state@, kind == 'c' and 'completed' or 'processing',
  @n@, string.format('%d:%s:%s', now - (retention - pttl), lease_ms, retention_ms),
  @owner@, string.sub(raw, 3, 38), @fp@, string.sub(raw, 75, 138),
  @cur_id@, string.sub(raw, 39, 74),
  form == 'b' and @tenant_bin@ or @tenant@, tenant, @op@, op, @key@, key, @v@, '2'}
if kind == 'a' then
  -- Waited on (watch.lua): the hash keeps the mark.
  table.insert(fields, @w@)
  table.insert(fields, '1')
end
local response_key = record .. ':r'
if kind == 'c' then
  local status, stored, ended_ms, headers_length
  _, ended, status, stored, ended_ms, headers_length =
    string.find(raw, '^(%d*):(%d):(%d+):(%d+):', at)
  if not ended then return corrupt() end
  local split = ended + tonumber(headers_length)
  local headers, body = string.sub(raw, ended + 1, split), string.sub(raw, split + 1)
  table.insert(fields, @d@)
  table.insert(fields, status .. ':' .. stored .. ':' .. ended_ms)
  if #headers <= 64 and #body <= 64 then
    table.insert(fields, @headers@)
    table.insert(fields, headers)
    table.insert(fields, @body@)
    table.insert(fields, body)
  else
    -- As complete.lua keeps a response too long for the compact encoding.
    redis.call('SET', response_key, headers .. body, 'PX', pttl)
    table.insert(fields, @split@)
    table.insert(fields, headers_length)
  end
end
redis.call('DEL', record)
redis.call('HSET', record, unpack(fields))
redis.call('PEXPIRE', record, pttl)
return 1
