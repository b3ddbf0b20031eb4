-- The store's clock, in Unix milliseconds (see scripts.rs: the `--@clock`
-- line of a script is where it is read, before its body when it has none).
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
