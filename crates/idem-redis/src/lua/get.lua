-- ARGV[1], optional: 'processing' answers only a processing record (a
-- listing of stuck records then reads one field of every other record
-- instead of all of them); '' for any state.
-- ARGV[2] and ARGV[3], optional: a tenant, as the 'tenant' field holds it
-- and as the 'tenant_bin' field holds it ('' when it has no binary form,
-- see decode.rs): a record of another tenant answers like an absent one,
-- so a tenant's listing reads a few fields of every other record.
-- The live record as HGETALL pairs, or an empty list. A packed record is
-- read as it is (see all_fields), not expanded; a string record (format
-- 3) likewise.
local read = redis.pcall('HMGET', record, @state@, @expires@, @n@, @tenant@, @tenant_bin@)
local state, tenant, tenant_bin
-- A record kept as one string (format 3): its fields as the hash it
-- stands for (string_record.lua), read without rewriting it. Redis hands
-- a script only a live key.
local fields, found, headers, body
if read.err then
  local raw = redis.pcall('GET', record)
  if type(raw) ~= 'string' then
    return redis.error_reply(read.err)
  end
  fields, headers, body = string_fields(raw, redis.call('PEXPIRETIME', record), now)
  if not fields then
    return headers
  end
  found = {}
  for i = 1, #fields, 2 do
    found[fields[i]] = fields[i + 1]
  end
  state, tenant, tenant_bin = found[@state@], found[@tenant@], found[@tenant_bin@]
else
  local expires, n
  state, expires, n, tenant, tenant_bin = unpack(read)
  if n then
    local started, retention_ms = string.match(n, '^(%d+):%d+:(%d+)$')
    expires = tonumber(started) + tonumber(retention_ms)
  end
  if not live(state, expires) then
    return {}
  end
end
if ARGV[1] == 'processing' and state ~= 'processing' then
  return {}
end
if ARGV[2] and tenant ~= ARGV[2] and (ARGV[3] == '' or tenant_bin ~= ARGV[3]) then
  return {}
end
if not fields then
  return rare().all_fields()
end
if headers then
  table.insert(fields, @headers@)
  table.insert(fields, headers)
  table.insert(fields, @body@)
  table.insert(fields, body)
end
for _, value in ipairs(unpacked(found[@n@], found[@d@], state)) do
  table.insert(fields, value)
end
return fields
