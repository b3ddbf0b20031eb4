-- ARGV[1], optional: 'processing' answers only a processing record (a
-- listing of stuck records then reads one field of every other record
-- instead of all of them). The live record as HGETALL pairs, or an empty
-- list. A packed record is read as it is (see all_fields), not expanded.
local state, expires, n = unpack(redis.call('HMGET', record, 'state', 'expires', 'n'))
if n then
  local started, retention_ms = string.match(n, '^(%d+):%d+:(%d+)$')
  expires = tonumber(started) + tonumber(retention_ms)
end
if not live(state, expires) or (ARGV[1] == 'processing' and state ~= 'processing') then
  return {}
end
return rare().all_fields()
