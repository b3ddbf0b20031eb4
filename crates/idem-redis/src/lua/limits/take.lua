-- The next turn of a boundary (GCRA), on the Redis clock, in microseconds.
-- KEYS[1]: the boundary's theoretical arrival time; KEYS[2]: its cooldown.
-- ARGV: interval, tolerance (interval x (burst - 1)), the caller's bound.
-- Answers {1, wait} (the turn is taken: go after wait), {0, wait} (cooling
-- down for wait) or {-1, wait} (the turn would come after the bound;
-- nothing taken).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cool = tonumber(redis.call('GET', KEYS[2]) or '0')
if cool > now then
  return {0, string.format('%.0f', cool - now)}
end
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local bound = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then
  tat = now
end
local wait = tat - tolerance - now
if wait < 0 then
  wait = 0
end
if wait > bound then
  return {-1, string.format('%.0f', wait)}
end
local next_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', next_tat),
  'PX', math.floor((next_tat - now) / 1000) + 1000)
return {1, string.format('%.0f', wait)}
