package control

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"go.uber.org/zap"
)

// TestTheBearerSchemeIsCaseInsensitive: RFC 9110 makes the scheme
// case-insensitive, so "bearer" and "BEARER" carry the admin token as
// "Bearer" does; the token itself still has to match exactly.
func TestTheBearerSchemeIsCaseInsensitive(t *testing.T) {
	a := &API{Token: "s3cret", Logger: zap.NewNop(), ClientIP: func(*http.Request) (string, error) { return "192.0.2.1", nil }}
	call := a.admin(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	for auth, want := range map[string]int{
		"Bearer s3cret": 200, "bearer s3cret": 200, "BEARER s3cret": 200, "Bearer  s3cret": 200,
		"bearer S3CRET": 403, "Bearer": 403, "Bearers3cret": 403, "Basic s3cret": 403, "s3cret": 403, "": 403,
	} {
		r := httptest.NewRequest("POST", "/workers", nil)
		r.Header.Set("Authorization", auth)
		w := httptest.NewRecorder()
		call(w, r)
		if w.Code != want {
			t.Errorf("Authorization %q: %d; want %d", auth, w.Code, want)
		}
		if want == 403 && w.Header().Get("Content-Type") != "application/json" {
			t.Errorf("Authorization %q: refused as %q, not a JSON error", auth, w.Header().Get("Content-Type"))
		}
	}
}
