-- Reads a record kept as one string (record format 3, string_record.rs):
-- shared by convert.lua, which rewrites it as the hash it stands for, and
-- get.lua, which reads it as it is.
-- `string_fields(raw, expires_at, now)` answers the fields of the packed
-- format 2 hash it stands for (head.lua) as name, value pairs, then the
-- stored response's headers and body (a completed record's; nil
-- otherwise); or nil and an error reply for a string of a newer format,
-- or one that does not parse. `expires_at` is the key's expiry
-- (PEXPIRETIME, Unix ms by Redis' clock) and `now` Redis' clock: the
-- reservation began a retention before the expiry, or at the start the
-- record carries (its writer's clock), whichever is later: the hash's
-- start, from which its lease follows. An expiry changed from outside (an
-- operator's PEXPIRE) so never shortens a live lease; a lengthened expiry
-- lengthens a processing record's lease by as much, and the writer's clock
-- skew may lengthen one too. (The key's expiry, not its
-- remaining time: every read of one record answers the same start.)
local function string_fields(raw, expires_at, now)
  local version = string.sub(raw, @S_VERSION_AT@, @S_VERSION_AT@)
  if version ~= @S_VERSION@ then
    if string.match(version, '^%d$') and tonumber(version) > @S_NUMBER@ then
      return nil, redis.error_reply('idem: record format ' .. version ..
        ' is newer than this store reads (@S_NUMBER@); upgrade every instance')
    end
    return nil, redis.error_reply('idem: a string record of no known format')
  end
  local corrupt = redis.error_reply('idem: a string record that does not parse')
  local kind = string.sub(raw, @S_STATE_AT@, @S_STATE_AT@)
  local _, at, carried, lease_ms, retention_ms, form, length =
    string.find(raw, '^(%d+):(%d+):(%d+):([tb])(%d+):', @S_VARIABLE_AT@)
  if not at or (kind ~= @S_PROCESSING@ and kind ~= @S_WATCHED@ and kind ~= @S_COMPLETED@) then
    return nil, corrupt
  end
  -- A field led by its length, from `from`; and where the next begins.
  local function field(from, length)
    return string.sub(raw, from, from + length - 1), from + length
  end
  local tenant, op, key, ended
  tenant, at = field(at + 1, tonumber(length))
  _, ended = string.find(raw, '^%d+:', at)
  if not ended then return nil, corrupt end
  op, at = field(ended + 1, tonumber(string.sub(raw, at, ended - 1)))
  _, ended = string.find(raw, '^%d+:', at)
  if not ended then return nil, corrupt end
  key, at = field(ended + 1, tonumber(string.sub(raw, at, ended - 1)))
  local retention = tonumber(retention_ms)
  if expires_at < 0 then
    -- No expiry (set by hand): as if reserved now.
    expires_at = now + retention
  end
  local fields = {@state@, kind == @S_COMPLETED@ and 'completed' or 'processing',
    @n@, string.format('%d:%s:%s', math.max(expires_at - retention, tonumber(carried)),
      lease_ms, retention_ms),
    @owner@, string.sub(raw, @S_OWNER_FROM@, @S_OWNER_TO@), @fp@, string.sub(raw, @S_FP_FROM@, @S_FP_TO@),
    @cur_id@, string.sub(raw, @S_ATTEMPT_FROM@, @S_ATTEMPT_TO@),
    form == 'b' and @tenant_bin@ or @tenant@, tenant, @op@, op, @key@, key, @v@, '2'}
  if kind == @S_WATCHED@ then
    -- Waited on (watch.lua): the hash keeps the mark.
    table.insert(fields, @w@)
    table.insert(fields, '1')
  end
  if kind ~= @S_COMPLETED@ then
    return fields
  end
  local status, stored, ended_ms, headers_length
  _, ended, status, stored, ended_ms, headers_length =
    string.find(raw, '^(%d*):(%d):(%d+):(%d+):', at)
  if not ended then return nil, corrupt end
  table.insert(fields, @d@)
  table.insert(fields, status .. ':' .. stored .. ':' .. ended_ms)
  local split = ended + tonumber(headers_length)
  return fields, string.sub(raw, ended + 1, split), string.sub(raw, split + 1)
end
