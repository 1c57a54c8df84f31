package testrouter

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// IsolateHome points HOME and the XDG directories at a fresh temporary
// directory, named after pattern as by os.MkdirTemp, so Caddy writes nothing
// in the user's home. The returned function removes the directory.
func IsolateHome(pattern string) (func(), error) {
	tmp, err := os.MkdirTemp("", pattern)
	if err != nil {
		return nil, err
	}
	for _, v := range []struct{ name, dir string }{
		{"HOME", tmp},
		{"XDG_CONFIG_HOME", filepath.Join(tmp, "config")},
		{"XDG_DATA_HOME", filepath.Join(tmp, "data")},
		{"XDG_CACHE_HOME", filepath.Join(tmp, "cache")},
	} {
		os.Setenv(v.name, v.dir)
	}
	// Caddy fixed its default storage path when the package was
	// initialised, before HOME changed; its TLS app leaves a storage-clean
	// stamp there even with auto_https off.
	caddy.DefaultStorage.Path = caddy.AppDataDir()
	return func() { os.RemoveAll(tmp) }, nil
}

// Main runs a test binary's tests with HOME isolated, for a TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(testrouter.Main(m, "mypkg-test")) }
//
// It returns the exit code for os.Exit.
func Main(m *testing.M, pattern string) int {
	clean, err := IsolateHome(pattern)
	if err != nil {
		panic(err)
	}
	defer clean()
	return m.Run()
}
