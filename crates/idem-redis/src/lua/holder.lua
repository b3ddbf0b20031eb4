-- What complete and release check first (at their `--@holder` line), the
-- caller's hold on the lease: the record's state, generation, owner and
-- waiters' mark (w), and n when the record is packed. The generation is
-- gen, or 1 in a packed record: a store looks first for the field its own
-- new records have, and reads the other only for a record of the other
-- layout.
local state, first, owner, watched = unpack(redis.call('HMGET', record, @state@,
  PACKED and @n@ or @gen@, @owner@, @w@))
local gen, n
if PACKED then n = first else gen = first end
if state and not first then
  if PACKED then
    gen = redis.call('HGET', record, @gen@)
  else
    n = redis.call('HGET', record, @n@)
  end
end
if n then
  gen = '1'
end
