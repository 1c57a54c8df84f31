package request

import (
	"net/url"
	"testing"
)

func TestCanonicalPaths(t *testing.T) {
	for _, c := range []struct{ target, path, escaped string }{
		{"/v1/set_lora/", "/v1/set_lora", "/v1/set_lora"},
		{"//v1//set_lora", "/v1/set_lora", "/v1/set_lora"},
		{"/v1/set_lora;x=1", "/v1/set_lora", "/v1/set_lora"},
		{"/v1;x=1/set_lora;y/", "/v1/set_lora", "/v1/set_lora"},
		{"/workers/http:%2F%2F10.0.0.1:30000/", "/workers/http://10.0.0.1:30000", "/workers/http:%2F%2F10.0.0.1:30000"},
		{"/v1%2Fset_lora/", "/v1/set_lora", "/v1%2Fset_lora"},
		{"/v1/images/..;x/set_lora", "/v1/images/../set_lora", "/v1/images/../set_lora"},
		{"//", "/", "/"},
		{"/;x", "/", "/"},
	} {
		u, err := url.ParseRequestURI(c.target)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := Canonical(u)
		if !ok || got.Path != c.path || got.EscapedPath() != c.escaped {
			t.Errorf("%s: canonical %q (escaped %q), %v; want %q (escaped %q)", c.target, got.Path, got.EscapedPath(), ok, c.path, c.escaped)
		}
		if u.EscapedPath() == got.EscapedPath() {
			t.Errorf("%s: Canonical changed u", c.target)
		}
	}
	for _, target := range []string{"/", "/v1/set_lora", "/v1/images/generations?x=a;b//", "/v1%2Fset_lora", "/v1/%73et_lora"} {
		u, _ := url.ParseRequestURI(target)
		if got, ok := Canonical(u); ok || got != u {
			t.Errorf("%s: %v, %v; want itself", target, got, ok)
		}
	}
}
