-- ARGV[1], optional: 'processing' answers only a processing record (a
-- listing of stuck records then reads one field of every other record
-- instead of all of them); '' for any state.
-- ARGV[2] and ARGV[3], optional: a tenant, as the 'tenant' field holds it
-- and as the 'tenant_bin' field holds it ('' when it has no binary form,
-- see decode.rs): a record of another tenant answers like an absent one,
-- so a tenant's listing reads a few fields of every other record.
-- The live record as HGETALL pairs, or an empty list. A packed record is
-- read as it is (see all_fields), not expanded.
local state, expires, n, tenant, tenant_bin =
  unpack(redis.call('HMGET', record, @state@, @expires@, @n@, @tenant@, @tenant_bin@))
if n then
  local started, retention_ms = string.match(n, '^(%d+):%d+:(%d+)$')
  expires = tonumber(started) + tonumber(retention_ms)
end
if not live(state, expires) or (ARGV[1] == 'processing' and state ~= 'processing') then
  return {}
end
if ARGV[2] and tenant ~= ARGV[2] and (ARGV[3] == '' or tenant_bin ~= ARGV[3]) then
  return {}
end
return rare().all_fields()
