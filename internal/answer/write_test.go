package answer

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// The Python router's clients read its errors as {"error": "..."}.
func TestWriteErrorHasThePythonRoutersShape(t *testing.T) {
	rec := httptest.NewRecorder()
	if err := WriteError(rec, http.StatusNotFound, `Worker "a" not found`); err != nil {
		t.Fatal(err)
	}
	want := `{"error":"Worker \"a\" not found"}` + "\n"
	if rec.Code != http.StatusNotFound || rec.Header().Get("Content-Type") != "application/json" || rec.Body.String() != want {
		t.Fatalf("%d %q %s; want 404 application/json %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body, want)
	}
}
