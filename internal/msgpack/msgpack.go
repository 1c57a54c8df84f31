// Package msgpack is a small MessagePack codec for the answers
// sglang-diffusion's rollout API sends (msgspec.msgpack.encode of a list of
// RolloutResponse dicts): an encoder for the fake worker, a decoder to
// plain Go values for tests and benchmarks, and Whole, a cheap check that a
// body is one complete value, for the router to refuse answers cut short.
//
// It is hand-written rather than a dependency because the project needs
// little of the format (no extensions beyond keeping their bytes, no struct
// tags, no streaming) and must not pull in a codec for the sake of a fake
// and a framing walk. It does not import Caddy.
package msgpack

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
)

// The format's type bytes this package uses; the others are ranges
// (fixint, fixstr, fixarray, fixmap) handled where they are read.
const (
	tagNil      = 0xc0
	tagNever    = 0xc1 // never used by the format: always invalid
	tagFalse    = 0xc2
	tagTrue     = 0xc3
	tagBin8     = 0xc4
	tagBin16    = 0xc5
	tagBin32    = 0xc6
	tagExt8     = 0xc7
	tagExt16    = 0xc8
	tagExt32    = 0xc9
	tagFloat32  = 0xca
	tagFloat64  = 0xcb
	tagUint8    = 0xcc
	tagUint16   = 0xcd
	tagUint32   = 0xce
	tagUint64   = 0xcf
	tagInt8     = 0xd0
	tagInt16    = 0xd1
	tagInt32    = 0xd2
	tagInt64    = 0xd3
	tagFixExt1  = 0xd4
	tagFixExt16 = 0xd8
	tagStr8     = 0xd9
	tagStr16    = 0xda
	tagStr32    = 0xdb
	tagArray16  = 0xdc
	tagArray32  = 0xdd
	tagMap16    = 0xde
	tagMap32    = 0xdf
)

// KV is one entry of a Map.
type KV struct {
	Key   string
	Value any
}

// Map is a map with string keys whose entries are encoded in the order
// given. Python dicts (and so msgspec's output) keep insertion order, and a
// fake that answers byte for byte as sglang does must keep it too; a Go map
// cannot.
type Map []KV

// Get returns the value of the first entry named key.
func (m Map) Get(key string) (any, bool) {
	for _, kv := range m {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return nil, false
}

// Keys returns the keys of m in order, for tests of field order.
func (m Map) Keys() []string {
	keys := make([]string, len(m))
	for i, kv := range m {
		keys[i] = kv.Key
	}
	return keys
}

// Ext is an extension value: a type number and its bytes, kept as they
// are. Nothing this project exchanges uses one; the decoder keeps them so
// that a body holding one still decodes.
type Ext struct {
	Type int8
	Data []byte
}

// Marshal returns the MessagePack encoding of v; see Append for the types
// it takes.
func Marshal(v any) ([]byte, error) {
	return Append(nil, v)
}

// Append appends the encoding of v to b. It takes nil, bool, the integer
// types, float32, float64, string, []byte (bin), []any, []string, []int,
// []int64, []float64, []Map, Map, map[string]any (keys sorted, so that the
// output is deterministic) and Ext. Every value takes its shortest form, as
// msgspec and msgpack-python write it; a float64 stays 8 bytes even when a
// float32 would hold it, as msgspec writes Python floats.
func Append(b []byte, v any) ([]byte, error) {
	switch v := v.(type) {
	case nil:
		return append(b, tagNil), nil
	case bool:
		if v {
			return append(b, tagTrue), nil
		}
		return append(b, tagFalse), nil
	case int:
		return appendInt(b, int64(v)), nil
	case int8:
		return appendInt(b, int64(v)), nil
	case int16:
		return appendInt(b, int64(v)), nil
	case int32:
		return appendInt(b, int64(v)), nil
	case int64:
		return appendInt(b, v), nil
	case uint:
		return appendUint(b, uint64(v)), nil
	case uint8:
		return appendUint(b, uint64(v)), nil
	case uint16:
		return appendUint(b, uint64(v)), nil
	case uint32:
		return appendUint(b, uint64(v)), nil
	case uint64:
		return appendUint(b, v), nil
	case float32:
		return be32(append(b, tagFloat32), math.Float32bits(v)), nil
	case float64:
		return be64(append(b, tagFloat64), math.Float64bits(v)), nil
	case string:
		return AppendString(b, v), nil
	case []byte:
		return appendBin(b, v), nil
	case Ext:
		return appendExt(b, v), nil
	case Map:
		b = appendHeader(b, 0x80, tagMap16, len(v))
		for _, kv := range v {
			b = AppendString(b, kv.Key)
			var err error
			if b, err = Append(b, kv.Value); err != nil {
				return b, fmt.Errorf("%s: %w", kv.Key, err)
			}
		}
		return b, nil
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		m := make(Map, len(keys))
		for i, k := range keys {
			m[i] = KV{k, v[k]}
		}
		return Append(b, m)
	case []any:
		return appendList(b, v)
	case []Map:
		return appendList(b, v)
	case []string:
		return appendList(b, v)
	case []int:
		return appendList(b, v)
	case []int64:
		return appendList(b, v)
	case []float64:
		return appendList(b, v)
	}
	return b, fmt.Errorf("msgpack: cannot encode %T", v)
}

func appendList[T any](b []byte, list []T) ([]byte, error) {
	b = appendHeader(b, 0x90, tagArray16, len(list))
	for i, v := range list {
		var err error
		if b, err = Append(b, v); err != nil {
			return b, fmt.Errorf("[%d]: %w", i, err)
		}
	}
	return b, nil
}

// AppendString appends s as a MessagePack str. It is exported for callers
// that write a large string (base64 of a tensor) without building a value
// around it.
func AppendString(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, tagStr8, byte(n))
	case n <= math.MaxUint16:
		b = be16(append(b, tagStr16), uint16(n))
	default:
		b = be32(append(b, tagStr32), uint32(n))
	}
	return append(b, s...)
}

func appendBin(b, data []byte) []byte {
	switch n := len(data); {
	case n <= math.MaxUint8:
		b = append(b, tagBin8, byte(n))
	case n <= math.MaxUint16:
		b = be16(append(b, tagBin16), uint16(n))
	default:
		b = be32(append(b, tagBin32), uint32(n))
	}
	return append(b, data...)
}

func appendExt(b []byte, e Ext) []byte {
	switch n := len(e.Data); {
	case n == 1 || n == 2 || n == 4 || n == 8 || n == 16:
		b = append(b, tagFixExt1+byte(bitsLen(n)))
	case n <= math.MaxUint8:
		b = append(b, tagExt8, byte(n))
	case n <= math.MaxUint16:
		b = be16(append(b, tagExt16), uint16(n))
	default:
		b = be32(append(b, tagExt32), uint32(n))
	}
	return append(append(b, byte(e.Type)), e.Data...)
}

// bitsLen is log2 of a fixext size: 1→0, 2→1, 4→2, 8→3, 16→4.
func bitsLen(n int) int {
	k := 0
	for n > 1 {
		n >>= 1
		k++
	}
	return k
}

// appendHeader appends the header of an array or map of n entries: the
// fix form (fix|n) up to 15, then the 16- and 32-bit forms.
func appendHeader(b []byte, fix, tag16 byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, fix|byte(n))
	case n <= math.MaxUint16:
		return be16(append(b, tag16), uint16(n))
	}
	return be32(append(b, tag16+1), uint32(n))
}

func appendInt(b []byte, v int64) []byte {
	switch {
	case v >= 0:
		return appendUint(b, uint64(v))
	case v >= -32:
		return append(b, byte(v)) // negative fixint
	case v >= math.MinInt8:
		return append(b, tagInt8, byte(v))
	case v >= math.MinInt16:
		return be16(append(b, tagInt16), uint16(v))
	case v >= math.MinInt32:
		return be32(append(b, tagInt32), uint32(v))
	}
	return be64(append(b, tagInt64), uint64(v))
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v)) // positive fixint
	case v <= math.MaxUint8:
		return append(b, tagUint8, byte(v))
	case v <= math.MaxUint16:
		return be16(append(b, tagUint16), uint16(v))
	case v <= math.MaxUint32:
		return be32(append(b, tagUint32), uint32(v))
	}
	return be64(append(b, tagUint64), v)
}

func be16(b []byte, v uint16) []byte { return append(b, byte(v>>8), byte(v)) }
func be32(b []byte, v uint32) []byte {
	return append(b, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
}
func be64(b []byte, v uint64) []byte { return be32(be32(b, uint32(v>>32)), uint32(v)) }

// Errors of Whole and the decoders, wrapped with the offset where they
// were found.
var (
	// ErrIncomplete is a body that ends inside its value: cut short.
	ErrIncomplete = errors.New("msgpack: body ends inside a value")
	// ErrTrailing is a complete value followed by more bytes.
	ErrTrailing = errors.New("msgpack: bytes after the value")
	// ErrInvalid is a byte no MessagePack value starts with (0xc1).
	ErrInvalid = errors.New("msgpack: invalid type byte")
)

// Whole reports whether data is exactly one complete MessagePack value:
// nil, or an error wrapping ErrIncomplete (the body was cut short),
// ErrTrailing or ErrInvalid. It walks the framing only: it counts the
// entries arrays and maps announce and steps over str, bin and ext payloads
// by their lengths without reading them, so it costs one step per value,
// not per byte (a 100 MB tensor in base64 is one step), allocates nothing
// and keeps no stack, however deep the nesting. It does not check that
// strings are UTF-8 or map keys strings: it answers "was this cut short?",
// which is what a router must know before it calls an answer a success.
func Whole(data []byte) error {
	var s Stream
	s.Feed(data)
	return s.End()
}

// Stream is Whole for a body that comes in pieces, as an answer streamed
// through the router does: Feed it each piece in order, then End. It keeps
// a count of the values still owed, the payload bytes still to step over
// and a type byte whose length field the piece cut off, never the body.
// The zero Stream is ready for a body's first piece.
type Stream struct {
	begun   bool
	pending int     // values still to read: the body's own, plus what its arrays and maps announced
	skip    int     // payload bytes of the last value still to step over
	head    [5]byte // a type byte and its length field, while a piece cut them
	headLen int     // bytes of head received
	offset  int     // bytes fed before this piece
	err     error
}

// Feed checks the next piece of the body. After an error it does nothing:
// End reports the first.
func (s *Stream) Feed(p []byte) {
	if !s.begun {
		s.pending, s.begun = 1, true
	}
	i := 0
	if s.headLen > 0 { // the piece before ended inside a header
		if i = s.finishHeader(p); s.headLen > 0 {
			s.offset += len(p)
			return
		}
	}
	// The loop keeps the counts in locals and reads the usual values in
	// place: a body of small values pays it for each byte.
	pending, skip := s.pending, s.skip
	for s.err == nil {
		if n := min(skip, len(p)-i); n > 0 {
			skip, i = skip-n, i+n
		}
		if i == len(p) {
			break
		}
		if pending == 0 {
			s.err = fmt.Errorf("%w (offset %d)", ErrTrailing, s.offset+i)
			break
		}
		c := p[i]
		pending--
		switch {
		case c <= 0x7f || c >= 0xe0 || c == tagNil || c == tagFalse || c == tagTrue:
			i++
		case c <= 0x8f:
			pending, i = pending+2*int(c&0x0f), i+1
		case c <= 0x9f:
			pending, i = pending+int(c&0x0f), i+1
		case c <= 0xbf:
			skip, i = int(c&0x1f), i+1
		case len(p)-i < headerSize(c): // the piece ends inside its length field
			s.head[0], s.headLen = c, copy(s.head[1:], p[i+1:])+1
			i = len(p)
		default:
			var entries int
			entries, skip = s.step(p[i:i+headerSize(c)], s.offset+i)
			pending, i = pending+entries, i+headerSize(c)
		}
	}
	s.pending, s.skip = pending, skip
	s.offset += len(p)
}

// finishHeader completes, from the start of p, the header the piece before
// cut off, and steps over it; it returns the offset in p past it, or
// len(p) while the header goes on.
func (s *Stream) finishHeader(p []byte) int {
	size := headerSize(s.head[0])
	n := copy(s.head[s.headLen:size], p)
	if s.headLen += n; s.headLen < size {
		return len(p)
	}
	s.headLen = 0
	entries, skip := s.step(s.head[:size], s.offset-size+n)
	s.pending, s.skip = s.pending+entries, skip
	return n
}

// headerSize is the size of a value's type byte and the length field after
// it.
func headerSize(c byte) int {
	if c < tagBin8 || c > tagMap32 {
		return 1
	}
	return 1 + lengthSize[c-tagBin8]
}

// step reads the header of a value of type 0xc1 to 0xdf, found at offset
// at, and returns the entries it announces and the payload bytes to step
// over.
func (s *Stream) step(head []byte, at int) (entries, skip int) {
	c := head[0]
	if c == tagNever {
		s.err = fmt.Errorf("%w 0xc1 at offset %d", ErrInvalid, at)
		return 0, 0
	}
	n := readUint(head[1:], len(head)-1)
	if n < 0 { // a 32-bit length beyond a 32-bit int: more than any body holds
		s.err = fmt.Errorf("%w (offset %d)", ErrIncomplete, at)
		return 0, 0
	}
	switch c {
	case tagBin8, tagBin16, tagBin32, tagStr8, tagStr16, tagStr32:
		return 0, n
	case tagExt8, tagExt16, tagExt32:
		return 0, n + 1 // the type byte
	case tagArray16, tagArray32:
		return n, 0
	case tagMap16, tagMap32:
		return 2 * n, 0
	}
	return 0, fixedPayload[c-tagBin8] // numbers and fixext: a fixed payload
}

// End reports whether the body fed was one whole value.
func (s *Stream) End() error {
	switch {
	case s.err != nil:
		return s.err
	case !s.begun || s.headLen > 0:
		return fmt.Errorf("%w (offset %d)", ErrIncomplete, s.offset)
	case s.pending > 0 || s.skip > 0:
		return fmt.Errorf("%w (offset %d, %d values and %d bytes missing)", ErrIncomplete, s.offset, s.pending, s.skip)
	}
	return nil
}

// lengthSize is, for the type bytes 0xc4 to 0xdf, the size of the length
// field that follows them (0 for types of a fixed size).
var lengthSize = [...]int{
	0: 1 /* bin8 */, tagBin16 - tagBin8: 2, tagBin32 - tagBin8: 4,
	tagExt8 - tagBin8: 1, tagExt16 - tagBin8: 2, tagExt32 - tagBin8: 4,
	tagStr8 - tagBin8: 1, tagStr16 - tagBin8: 2, tagStr32 - tagBin8: 4,
	tagArray16 - tagBin8: 2, tagArray32 - tagBin8: 4,
	tagMap16 - tagBin8: 2, tagMap32 - tagBin8: 4,
}

// fixedPayload is, for the type bytes 0xc4 to 0xdf of a fixed size, the
// bytes that follow them: numbers, and fixext's type byte and data.
var fixedPayload = [...]int{
	tagFloat32 - tagBin8: 4, tagFloat64 - tagBin8: 8,
	tagUint8 - tagBin8: 1, tagUint16 - tagBin8: 2, tagUint32 - tagBin8: 4, tagUint64 - tagBin8: 8,
	tagInt8 - tagBin8: 1, tagInt16 - tagBin8: 2, tagInt32 - tagBin8: 4, tagInt64 - tagBin8: 8,
	tagFixExt1 - tagBin8: 2, tagFixExt1 + 1 - tagBin8: 3, tagFixExt1 + 2 - tagBin8: 5,
	tagFixExt1 + 3 - tagBin8: 9, tagFixExt16 - tagBin8: 17,
	tagMap32 - tagBin8: 0,
}

// readUint reads a big-endian unsigned number of size bytes (1, 2, 4 or 8).
// On a 64-bit platform a 32-bit length always fits an int.
func readUint(b []byte, size int) int {
	n := 0
	for _, c := range b[:size] {
		n = n<<8 | int(c)
	}
	return n
}

// MaxDepth bounds how deep the decoders follow arrays and maps inside one
// another, so that a hostile body cannot exhaust the Go stack. Whole has
// no such limit: it keeps no stack.
const MaxDepth = 10000

// ErrTooDeep is a body nested beyond MaxDepth.
var ErrTooDeep = fmt.Errorf("msgpack: nested deeper than %d levels", MaxDepth)

// Unmarshal decodes data, which must be exactly one value, to plain Go
// values: nil, bool, int64 (uint64 for integers above math.MaxInt64),
// float32 or float64 as encoded, string, []byte for bin, Ext, []any and
// map[string]any (the last of repeated keys wins). A map key that is not a
// str is an error: nothing this project reads has one.
func Unmarshal(data []byte) (any, error) {
	return decode(data, false)
}

// UnmarshalOrdered is Unmarshal with maps decoded as Map, in their order
// and with any repeated keys, for tests of field order.
func UnmarshalOrdered(data []byte) (any, error) {
	return decode(data, true)
}

func decode(data []byte, ordered bool) (any, error) {
	d := decoder{data: data, ordered: ordered}
	v, err := d.value(0)
	if err != nil {
		return nil, err
	}
	if d.i != len(data) {
		return nil, fmt.Errorf("%w (offset %d, %d bytes)", ErrTrailing, d.i, len(data)-d.i)
	}
	return v, nil
}

type decoder struct {
	data    []byte
	i       int
	ordered bool
}

func (d *decoder) short() error {
	return fmt.Errorf("%w (offset %d)", ErrIncomplete, len(d.data))
}

// take returns the next n bytes.
func (d *decoder) take(n int) ([]byte, error) {
	if n > len(d.data)-d.i {
		return nil, d.short()
	}
	b := d.data[d.i : d.i+n]
	d.i += n
	return b, nil
}

func (d *decoder) uint(size int) (uint64, error) {
	b, err := d.take(size)
	var n uint64
	for _, c := range b {
		n = n<<8 | uint64(c)
	}
	return n, err
}

func (d *decoder) value(depth int) (any, error) {
	if d.i >= len(d.data) {
		return nil, d.short()
	}
	c := d.data[d.i]
	d.i++
	switch {
	case c <= 0x7f:
		return int64(c), nil
	case c >= 0xe0:
		return int64(int8(c)), nil
	case c <= 0x8f:
		return d.mapping(int(c&0x0f), depth)
	case c <= 0x9f:
		return d.array(int(c&0x0f), depth)
	case c <= 0xbf:
		b, err := d.take(int(c & 0x1f))
		return string(b), err
	}
	switch c {
	case tagNil:
		return nil, nil
	case tagFalse:
		return false, nil
	case tagTrue:
		return true, nil
	case tagNever:
		return nil, fmt.Errorf("%w 0xc1 at offset %d", ErrInvalid, d.i-1)
	case tagFloat32:
		n, err := d.uint(4)
		return math.Float32frombits(uint32(n)), err
	case tagFloat64:
		n, err := d.uint(8)
		return math.Float64frombits(n), err
	case tagUint8, tagUint16, tagUint32, tagUint64:
		n, err := d.uint(1 << (c - tagUint8))
		if n > math.MaxInt64 {
			return n, err
		}
		return int64(n), err
	case tagInt8:
		n, err := d.uint(1)
		return int64(int8(n)), err
	case tagInt16:
		n, err := d.uint(2)
		return int64(int16(n)), err
	case tagInt32:
		n, err := d.uint(4)
		return int64(int32(n)), err
	case tagInt64:
		n, err := d.uint(8)
		return int64(n), err
	}
	size := lengthSize[c-tagBin8]
	var n int
	if size > 0 {
		m, err := d.uint(size)
		if err != nil {
			return nil, err
		}
		n = int(m)
		if n < 0 { // a 32-bit length beyond a 32-bit int: more than any body holds
			return nil, d.short()
		}
	}
	switch c {
	case tagStr8, tagStr16, tagStr32:
		b, err := d.take(n)
		return string(b), err
	case tagBin8, tagBin16, tagBin32:
		b, err := d.take(n)
		return slices.Clone(b), err
	case tagArray16, tagArray32:
		return d.array(n, depth)
	case tagMap16, tagMap32:
		return d.mapping(n, depth)
	case tagExt8, tagExt16, tagExt32:
		n++ // the type byte
	default: // fixext
		n = fixedPayload[c-tagBin8]
	}
	b, err := d.take(n)
	if err != nil {
		return nil, err
	}
	return Ext{Type: int8(b[0]), Data: slices.Clone(b[1:])}, nil
}

// room checks that n values (each at least one byte) can still follow,
// before anything is allocated for them.
func (d *decoder) room(n int, depth int) error {
	if depth >= MaxDepth {
		return ErrTooDeep
	}
	if n > len(d.data)-d.i {
		return d.short()
	}
	return nil
}

func (d *decoder) array(n, depth int) (any, error) {
	if err := d.room(n, depth); err != nil {
		return nil, err
	}
	list := make([]any, n)
	for i := range list {
		var err error
		if list[i], err = d.value(depth + 1); err != nil {
			return nil, err
		}
	}
	return list, nil
}

func (d *decoder) mapping(n, depth int) (any, error) {
	if err := d.room(2*n, depth); err != nil {
		return nil, err
	}
	var m Map
	var plain map[string]any
	if d.ordered {
		m = make(Map, 0, n)
	} else {
		plain = make(map[string]any, n)
	}
	for range n {
		at := d.i
		k, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		key, ok := k.(string)
		if !ok {
			return nil, fmt.Errorf("msgpack: map key of type %T at offset %d; only str keys are read", k, at)
		}
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		if d.ordered {
			m = append(m, KV{key, v})
		} else {
			plain[key] = v
		}
	}
	if d.ordered {
		return m, nil
	}
	return plain, nil
}

// String renders m like a Go map literal in its order, for test messages.
func (m Map) String() string {
	var sb strings.Builder
	sb.WriteString("map[")
	for i, kv := range m {
		if i > 0 {
			sb.WriteByte(' ')
		}
		fmt.Fprintf(&sb, "%s:%v", kv.Key, kv.Value)
	}
	sb.WriteByte(']')
	return sb.String()
}
