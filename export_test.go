package diffusionrouter

// PoolHeld reports whether the registry that keeps pools across reloads
// holds a pool of that name. Nothing of the HTTP API can tell it when no
// config runs, which is when a test asks: after caddy.Validate.
func PoolHeld(name string) bool {
	_, held := pools.References(name)
	return held
}
