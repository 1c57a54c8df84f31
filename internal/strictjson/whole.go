package strictjson

import (
	"bytes"
	"errors"
	"fmt"
)

// Errors of Whole, wrapped with the offset where they were found.
var (
	// ErrIncomplete is a body that ends inside its value: cut short.
	ErrIncomplete = errors.New("JSON body ends inside a value")
	// ErrTrailing is a complete value followed by more than whitespace.
	ErrTrailing = errors.New("JSON body goes on after its value")
	// ErrStructure is a body whose brackets, commas, colons or literals
	// do not fit together.
	ErrStructure = errors.New("JSON body is not well formed")
)

// Whole reports whether body is exactly one complete JSON value, with
// whitespace around it: nil, or an error wrapping ErrIncomplete (the body
// was cut short), ErrTrailing, ErrStructure or ErrTooDeep. It is for a
// worker's answer, which the router must not call a success when it was
// cut short, not for a client's body (Scan reads those).
//
// It checks structure, not validity: brackets and braces, the commas and
// colons between them, keys being strings, true, false and null spelled
// out; it steps over strings with bytes.IndexByte and does not check their
// escapes or encoding, nor the digits of numbers. Answers are mostly
// base64 in strings, megabytes of it, so skipping a string at the speed of
// a memory scan is what makes the check cheap; json.Valid reads every byte
// through its state machine. A strict prefix of a whole object, array,
// string or literal is never whole; a top-level number cut short still
// reads as a number, which no check of the bytes alone can tell.
func Whole(body []byte) error {
	var s Stream
	s.Feed(body)
	return s.End()
}

// Stream is Whole for a body that comes in pieces, as an answer streamed
// through the router does: Feed it each piece in order, then End. It keeps
// the open brackets and where in a value the last piece ended, never the
// body. The zero Stream is ready for a body's first piece.
type Stream struct {
	stack   []byte // the open containers, '{' or '['
	state   state
	literal string // the rest of a true, false or null begun
	escaped bool   // in a string: the piece before ended in an odd run of backslashes
	offset  int    // bytes fed before this piece
	err     error
}

// state is where in the body the next byte falls.
type state uint8

const (
	valueNext    state = iota // a value starts (the body's, or after ':' or ',' in an array)
	valueOrClose              // after '[': a value, or ']'
	keyOrClose                // after '{': a key, or '}'
	keyNext                   // after ',' in an object: a key
	inKey                     // inside a key's string
	colonNext                 // after a key
	inString                  // inside a string value
	inLiteral                 // inside true, false or null
	inNumber                  // inside a number
	afterValue                // after a value: ',' or a closing bracket, or nothing at the top
)

// Feed checks the next piece of the body. After an error it does nothing:
// End reports the first.
func (s *Stream) Feed(p []byte) {
	if s.err != nil {
		return
	}
	// One loop, the state in locals and every step written out: most
	// answers are few bytes of structure around long strings, but a body
	// of small values pays this loop for each byte.
	st, stack := s.state, s.stack
	defer func() { s.state, s.stack = st, stack }()
	for i := 0; i < len(p); {
		switch st {
		case inKey, inString:
			end, closed := s.skipString(p, i)
			if i = end; closed && st == inKey {
				st = colonNext
			} else if closed {
				st = afterValue
			}
			continue
		case inLiteral:
			n := min(len(s.literal), len(p)-i)
			if string(p[i:i+n]) != s.literal[:n] {
				s.fail(ErrStructure, "bad literal", i)
				return
			}
			if s.literal, i = s.literal[n:], i+n; s.literal == "" {
				st = afterValue
			}
			continue
		case inNumber:
			for i < len(p) && isNumberByte(p[i]) {
				i++
			}
			if i < len(p) {
				st = afterValue
			}
			continue
		}
		c := p[i]
		if c <= ' ' && (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
			i++
			continue
		}
		switch st {
		case afterValue:
			switch {
			case len(stack) == 0:
				s.fail(ErrTrailing, "more than whitespace", i)
				return
			case c == ',' && stack[len(stack)-1] == '[':
				st = valueNext
			case c == ',':
				st = keyNext
			case c == stack[len(stack)-1]+2: // ']' is '['+2, '}' is '{'+2
				stack = stack[:len(stack)-1]
			default:
				s.unexpected(c, i)
				return
			}
		case colonNext:
			if c != ':' {
				s.fail(ErrStructure, "no colon after a key", i)
				return
			}
			st = valueNext
		case keyOrClose, keyNext:
			switch {
			case c == '"':
				st, s.escaped = inKey, false
			case c == '}' && st == keyOrClose:
				stack, st = stack[:len(stack)-1], afterValue
			default:
				s.fail(ErrStructure, "a key must be a string", i)
				return
			}
		default: // valueNext, valueOrClose
			switch c {
			case ']':
				if st != valueOrClose {
					s.unexpected(c, i)
					return
				}
				stack, st = stack[:len(stack)-1], afterValue
			case '"':
				st, s.escaped = inString, false
			case '{', '[':
				if len(stack) >= MaxDepth { // as encoding/json counts, empty ones too
					s.err = ErrTooDeep
					return
				}
				stack, st = append(stack, c), valueOrClose
				if c == '{' {
					st = keyOrClose
				}
			case 't', 'f', 'n':
				st, s.literal = inLiteral, literalRest[c]
			default:
				if !isNumberByte(c) {
					s.unexpected(c, i)
					return
				}
				st = inNumber
			}
		}
		i++
	}
	s.offset += len(p)
}

// literalRest is what follows the first letter of true, false and null.
var literalRest = [256]string{'t': "rue", 'f': "alse", 'n': "ull"}

// End reports whether the body fed was one whole value.
func (s *Stream) End() error {
	switch {
	case s.err != nil:
		return s.err
	case len(s.stack) == 0 && (s.state == afterValue || s.state == inNumber):
		return nil
	}
	return fmt.Errorf("%w (offset %d)", ErrIncomplete, s.offset)
}

// skipString steps over the bytes of a string from offset i of p and
// returns the offset past its closing quote, or len(p) (and false) when the
// string goes on into the next piece. Keys and short values are stepped
// over a byte at a time; past shortString bytes, the rest is found with
// IndexByte: a quote preceded by an odd run of backslashes is escaped, and
// as the runs before quotes are disjoint, counting them costs O(len) in
// all.
func (s *Stream) skipString(p []byte, i int) (int, bool) {
	escaped := s.escaped
	for end := min(len(p), i+shortString); i < end; i++ {
		switch c := p[i]; {
		case escaped:
			escaped = false
		case c == '\\':
			escaped = true
		case c == '"':
			return i + 1, true
		}
	}
	run := i // where the backslashes before a quote may start
	for {
		k := bytes.IndexByte(p[i:], '"')
		if k < 0 {
			s.escaped = oddBackslashes(p[run:], escaped)
			return len(p), false
		}
		j := i + k
		if !oddBackslashes(p[run:j], escaped) {
			return j + 1, true
		}
		i, run, escaped = j+1, j+1, false // an escaped quote ends any run
	}
}

// shortString is how many bytes of a string skipString reads one at a
// time before it calls IndexByte, which costs more than that to call.
const shortString = 16

// oddBackslashes reports whether b ends in an odd run of backslashes;
// carried is whether the bytes before b did, which counts when the run
// fills b.
func oddBackslashes(b []byte, carried bool) bool {
	n := 0
	for n < len(b) && b[len(b)-1-n] == '\\' {
		n++
	}
	return (n%2 == 1) != (n == len(b) && carried)
}

// unexpected records c, at offset i of the piece, as out of place.
func (s *Stream) unexpected(c byte, i int) {
	s.fail(ErrStructure, fmt.Sprintf("unexpected %q", c), i)
}

// fail records err at offset i of the piece being fed.
func (s *Stream) fail(err error, what string, i int) {
	s.err = fmt.Errorf("%w: %s at offset %d", err, what, s.offset+i)
}

func isNumberByte(c byte) bool {
	return '0' <= c && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}
