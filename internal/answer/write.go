package answer

import (
	"encoding/json"
	"net/http"
)

// WriteJSON answers with v as JSON: the router's own answers, which are not
// a worker's and need no check.
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	return json.NewEncoder(w).Encode(v)
}

// WriteError answers with the error shape of the Python router,
// {"error": "..."}, which its clients read.
func WriteError(w http.ResponseWriter, status int, msg string) error {
	return WriteJSON(w, status, map[string]string{"error": msg})
}
