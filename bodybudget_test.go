package diffusionrouter_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A body's memory comes from max_body_total as its bytes arrive, and it
// has body_timeout to arrive in: these tests send bodies slowly on raw
// connections and check what each sender, and the clients beside them,
// are answered.

// slowJob sends an image job's headers to r announcing length bytes, and
// the first bytes of body; the rest is the test's to send.
func slowJob(t *testing.T, r *testrouter.Router, length int, first string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(r.Base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	fmt.Fprintf(conn, "POST /v1/images/generations HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", length, first)
	return conn
}

// answerOf reads the answer to the request sent on conn.
func answerOf(t *testing.T, conn net.Conn) (*http.Response, map[string]any) {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	defer resp.Body.Close()
	var body map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatalf("status %d, body is not JSON: %v", resp.StatusCode, err)
	}
	return resp, body
}

// errorText is the message of an error answer in the Python router's shape.
func errorText(body map[string]any) string {
	msg, _ := body["error"].(string)
	return msg
}

// paddedImage is an image job's JSON body of exactly size bytes.
func paddedImage(size int) string {
	shape := `{"response_format":"b64_json","size":"64x64","num_inference_steps":1,"prompt":"%s"}`
	return fmt.Sprintf(shape, strings.Repeat("x", size-len(shape)+2))
}

func bodyGauge(t *testing.T, r *testrouter.Router) float64 {
	return testrouter.Value(t, r, "caddy_diffusion_request_body_bytes_held", nil)
}

// refused reads the bodies refused for reason so far: the counter lives
// as long as the process, through earlier tests and runs.
func refused(t *testing.T, r *testrouter.Router, reason string) float64 {
	return testrouter.Value(t, r, "caddy_diffusion_request_bodies_refused_total", map[string]string{"reason": reason})
}

func TestABodyWithNoRoomToStartGets503AndTheOneHoldingTheRoomFinishes(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+testrouter.URLs(ws)+
		"\n max_body 1MiB\n max_body_total 1MiB\n}"))

	// The first job's body takes every byte of the budget and stops short
	// of its end.
	refusedBefore := refused(t, r, "budget")
	big := paddedImage(1 << 20)
	holder := slowJob(t, r, len(big), big[:len(big)-10])
	testrouter.WaitFor(t, func() bool { return bodyGauge(t, r) == 1<<20 })

	started := time.Now()
	late := slowJob(t, r, len(testrouter.SmallImage), testrouter.SmallImage)
	resp, body := answerOf(t, late)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "5" || !strings.Contains(errorText(body), "max_body_total") {
		t.Fatalf("a job with no room: %d, Retry-After %q, %v; want 503, 5 and a message naming max_body_total", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if waited := time.Since(started); waited < 4*time.Second {
		t.Errorf("the job was refused after %v; it may wait 5 s for room", waited)
	}

	fmt.Fprint(holder, big[len(big)-10:])
	if resp, body := answerOf(t, holder); resp.StatusCode != 200 {
		t.Fatalf("the job that held the room: %d %v", resp.StatusCode, body)
	}
	testrouter.ExpectStatus(t, "a job once the room is back", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	if n := refused(t, r, "budget") - refusedBefore; n != 1 {
		t.Errorf("bodies refused for the budget: %v more, want 1", n)
	}
	testrouter.WaitFor(t, func() bool { return bodyGauge(t, r) == 0 })
}

func TestABodyPastBodyTimeoutGets408AndItsMemoryBack(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+testrouter.URLs(ws)+"\n body_timeout 1s\n}"))

	refusedBefore := refused(t, r, "timeout")
	started := time.Now()
	slow := slowJob(t, r, 64<<20, `{"prompt":"`+strings.Repeat("x", 100<<10))
	testrouter.WaitFor(t, func() bool { return bodyGauge(t, r) > 0 })
	resp, body := answerOf(t, slow)
	if resp.StatusCode != 408 || !strings.Contains(errorText(body), "body_timeout") {
		t.Fatalf("a body that never ends: %d %v; want 408 naming body_timeout", resp.StatusCode, body)
	}
	if took := time.Since(started); took < time.Second {
		t.Errorf("refused after %v, before body_timeout", took)
	}
	if !resp.Close {
		t.Errorf("the connection of an unread body stays open")
	}
	if held := bodyGauge(t, r); held != 0 {
		t.Errorf("%v bytes still held after the 408", held)
	}
	if n := refused(t, r, "timeout") - refusedBefore; n != 1 {
		t.Errorf("bodies refused for their time: %v more, want 1", n)
	}
	testrouter.ExpectStatus(t, "a job after the 408", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	if ws[0].Stats().Jobs != 1 {
		t.Errorf("the worker ran %d jobs; the slow one must not reach it", ws[0].Stats().Jobs)
	}
}

func TestABodyPastBodyTimeoutGets408OverHTTP2(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.StartWith(t, "servers {\n protocols h1 h2c\n}", "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n body_timeout 1s\n}")
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Protocols: &protocols}}
	defer client.CloseIdleConnections()

	body, send := io.Pipe()
	defer send.Close()
	go send.Write([]byte(`{"prompt":"a cat`)) // and nothing more
	req, _ := http.NewRequest("POST", r.Base+"/v1/images/generations", body)
	req.ContentLength = 1 << 20
	started := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var answer map[string]any
	json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if resp.ProtoMajor != 2 || resp.StatusCode != 408 || !strings.Contains(errorText(answer), "body_timeout") {
		t.Fatalf("a stalled body over HTTP/%d: %d %v; want 408 over HTTP/2 naming body_timeout", resp.ProtoMajor, resp.StatusCode, answer)
	}
	if took := time.Since(started); took < time.Second {
		t.Errorf("refused after %v, before body_timeout", took)
	}
	rp, err := client.Post(r.Base+"/v1/images/generations", "application/json", strings.NewReader(testrouter.SmallImage))
	if err != nil || rp.StatusCode != 200 {
		t.Fatalf("a job after the 408 over HTTP/2: %v %v", rp, err)
	}
	rp.Body.Close()
}

func TestABodyCutShortGets400AndReachesNoWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	conn := slowJob(t, r, len(testrouter.SmallImage)+50, testrouter.SmallImage)
	conn.(*net.TCPConn).CloseWrite() // the sender is done, 50 bytes short
	resp, body := answerOf(t, conn)
	if resp.StatusCode != 400 || !strings.Contains(errorText(body), "unexpected EOF") {
		t.Fatalf("a body cut short: %d %v; want 400 saying it ended early", resp.StatusCode, body)
	}
	testrouter.ExpectStatus(t, "a whole job after it", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	if ws[0].Stats().Jobs != 1 {
		t.Errorf("the worker ran %d jobs; the body cut short must not reach it", ws[0].Stats().Jobs)
	}
}
