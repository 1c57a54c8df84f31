// Command caddy is a Caddy binary with the miles-diffusion-router plugin built in.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/miles-rollout/miles-diffusion-router"
)

func main() {
	caddycmd.Main()
}
