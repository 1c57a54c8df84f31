package workerurl

import (
	"net/url"
	"strings"
	"testing"
)

func TestParseWorkerURL(t *testing.T) {
	good := map[string]string{
		"http://10.0.0.1:30000":     "http://10.0.0.1:30000",
		" HTTP://Worker-A:30000/ ":  "http://worker-a:30000",
		"https://gpu.example.com":   "https://gpu.example.com",
		"https://gpu.example.com.":  "https://gpu.example.com",
		"http://[::1]:30000":        "http://[::1]:30000",
		"http://127.0.0.1:30001/":   "http://127.0.0.1:30001",
		"https://[fd00::1]":         "https://[fd00::1]",
		"http://localhost:8080":     "http://localhost:8080",
		"http://node-7.cluster:300": "http://node-7.cluster:300",
		"http://w_1.svc:0300":       "http://w_1.svc:300",
		"http://[::ffff:10.0.0.1]":  "http://[::ffff:10.0.0.1]",
	}
	for in, want := range good {
		got, err := Parse(in)
		if err != nil || got != want {
			t.Errorf("Parse(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	bad := map[string]string{
		"":                                     "empty",
		"ftp://10.0.0.1":                       "http:// or https://",
		"10.0.0.1:30000":                       "http:// or https://",
		"http:10.0.0.1":                        "not a valid URL",
		"http://user:pw@10.0.0.1:30000":        "credentials",
		"http://10.0.0.1:30000/generate":       "path",
		"http://10.0.0.1:30000?x=1":            "query",
		"http://10.0.0.1:30000/v1/#x/../../..": "fragment",
		"http://10.0.0.1:30000/#":              "fragment",
		"http://10.0.0.1:30000#":               "fragment",
		"http://":                              "host",
		"http://10.0.0.1:0":                    "port",
		"http://10.0.0.1:99999":                "port",
		// A host that decodes to bytes no URL can carry.
		"http://169%252500":    "DNS name",
		"http://a%2500b:30000": "DNS name",
		"http://a b":           "not a valid URL",
		"http://-a.example":    "DNS name",
		// Cloud metadata and link-local, in every spelling.
		"http://169.254.169.254":                   "blocked",
		"http://169.254.10.1:30000":                "link-local",
		"http://[fe80::1]:30000":                   "blocked",
		"http://[fe80::1%25eth0]:30000":            "blocked",
		"http://metadata.google.internal":          "blocked",
		"http://METADATA.google.internal.:80":      "blocked",
		"http://metadata":                          "blocked",
		"http://metadata.goog":                     "blocked",
		"http://instance-data":                     "blocked",
		"http://instance-data.ec2.internal.":       "blocked",
		"http://100.100.100.200":                   "blocked",
		"http://[fd00:ec2::254]":                   "blocked",
		"http://[::169.254.169.254]":               "blocked",
		"http://[::ffff:169.254.169.254]":          "blocked",
		"http://[::ffff:a9fe:a9fe]":                "blocked",
		"http://[64:ff9b::169.254.169.254]":        "blocked",
		"http://0.0.0.0:2019":                      "blocked",
		"http://[::]:2019":                         "blocked",
		"http://224.0.0.1":                         "blocked",
		"http://2852039166":                        "numbers",
		"http://0xa9fea9fe":                        "numbers",
		"http://0xA9.0xFE.0xA9.0xFE":               "numbers",
		"http://0251.0376.0251.0376":               "numbers",
		"http://169.254.43518":                     "numbers",
		"http://0":                                 "numbers",
		"http://" + strings.Repeat("a", 64) + ".x": "DNS name",
	}
	for in, want := range bad {
		if got, err := Parse(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%q) = %q, %v; want an error mentioning %q", in, got, err, want)
		}
	}
}

// FuzzParseWorkerURL checks that whatever Parse accepts is in its
// canonical form: it parses back with net/url to the same scheme and host,
// and parsing it again gives it unchanged.
func FuzzParseWorkerURL(f *testing.F) {
	for _, seed := range []string{
		"http://10.0.0.1:30000", "https://gpu.example.com.", "http://[::1]:30000", "http://169%252500",
		"http://[::169.254.169.254]", "http://0xa9fea9fe", "HTTP://Worker-A:30000/", "http://[fe80::1%25eth0]:1",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		got, err := Parse(raw)
		if err != nil {
			return
		}
		u, err := url.Parse(got)
		if err != nil || u.Scheme+"://"+u.Host != got || u.Hostname() == "" {
			t.Fatalf("Parse(%q) = %q, which does not parse back (%v)", raw, got, err)
		}
		if again, err := Parse(got); err != nil || again != got {
			t.Fatalf("Parse(%q) = %q, but that gives %q, %v", raw, got, again, err)
		}
		if DialAddress(got) == got {
			t.Fatalf("no dial address for %q", got)
		}
	})
}

func TestSpellingsOfOneAddressAreOneKey(t *testing.T) {
	for _, spellings := range [][]string{
		{"http://127.0.0.1:30000", "http://localhost:30000", "http://[::ffff:127.0.0.1]:30000", "http://LOCALHOST.:30000"},
		{"http://10.0.0.1", "http://[::ffff:a00:1]:80", "http://10.0.0.1:80"},
	} {
		want := ""
		for _, raw := range spellings {
			u, err := Parse(raw)
			if err != nil {
				t.Fatalf("Parse(%q): %v", raw, err)
			}
			key := AddressKey(DialAddress(u))
			if want == "" {
				want = key
			}
			if key != want {
				t.Errorf("%s is %s; %s is %s", raw, key, spellings[0], want)
			}
		}
	}
	if AddressKey("workers.internal:30000") != "workers.internal:30000" || AddressKey("[::1]:30000") == AddressKey("127.0.0.1:30000") {
		t.Error("names and other addresses must keep their own keys")
	}
}
