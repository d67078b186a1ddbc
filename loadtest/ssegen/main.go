// ssegen: the SSE subscribers of loadtest/fanout.py, in Go (`--generator go`).
//
// Python's subscribers cost ~170% of this 2-core machine at 10,000 connections, more than the
// server they measure; these cost a fraction, so the server's own latency shows. They behave as
// fanout.py's _SseClient: raw HTTP/1.1 GETs with live=sse, every "seq=NNNNNNNN" in the bytes
// received counted once per subscriber with its arrival time, and a response that ends (the
// server's SSE cycle) reconnected at the last streamNextOffset.
//
// Protocol with fanout.py, one JSON line each way:
//
//	stdout {"ready": n}          once every subscriber has its response headers (or after 60 s)
//	stdin  {"sent": {...}, "acked": {...}}   seq -> CLOCK_MONOTONIC seconds, sent once the writer is done
//	stdout the summary (summary below), once deliveries drained (every one, or 5 s without progress)
//
// Times are CLOCK_MONOTONIC, which Python's time.monotonic() reads too: one clock for every
// process on the machine.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

var (
	origin     time.Time // when monoOrigin was read
	monoOrigin float64   // CLOCK_MONOTONIC then, seconds
)

func monotonicNow() float64 {
	var ts syscall.Timespec
	// CLOCK_MONOTONIC is 1; syscall has no ClockGettime of its own.
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 1, uintptr(unsafe.Pointer(&ts)), 0)
	return float64(ts.Sec) + float64(ts.Nsec)/1e9
}

// now: CLOCK_MONOTONIC seconds, from Go's own monotonic clock (no system call per read).
func now() float64 { return monoOrigin + time.Since(origin).Seconds() }

type subscriber struct {
	mu         sync.Mutex
	received   []float64 // by seq: its arrival time, 0 while not received
	count      int       // seqs received (each once)
	duplicates int
	reconnects int
	refused    int // responses other than 200 (a server at a limit, a wrong path): retried
	offset     string
	conn       net.Conn // the connection now open, closed at the end
}

var seqMark = []byte("seq=")
var offsetMark = []byte(`"streamNextOffset":"`)
var lastChunk = []byte("\r\n0\r\n\r\n")

// run keeps one subscriber connected until stop, reconnecting after the server ends a response.
// first is called once: true when its first response's headers arrived, false if it never connected.
func (s *subscriber) run(addr, path string, first func(bool), stop <-chan struct{}) {
	signalled := false
	signal := func(ok bool) {
		if !signalled {
			signalled = true
			first(ok)
		}
	}
	defer signal(false)
	for failures := 0; ; {
		select {
		case <-stop:
			return
		default:
		}
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			if failures++; failures > 50 { // as fanout.py: 50 tries in a row, 0.2 s apart
				return
			}
			time.Sleep(200 * time.Millisecond)
			continue
		}
		failures = 0
		s.mu.Lock() // (main takes it for good at the end: no connection is kept after that)
		s.conn = conn
		s.mu.Unlock()
		request := fmt.Sprintf("GET %s?offset=%s&live=sse HTTP/1.1\r\nHost: %s\r\nAccept: text/event-stream\r\n\r\n",
			path, s.offset, addr)
		refused := false
		if _, err := conn.Write([]byte(request)); err == nil {
			refused = !s.read(conn, func() { signal(true) })
		}
		conn.Close()
		select {
		case <-stop:
			return
		default:
			s.mu.Lock()
			if refused {
				s.refused++
			} else {
				s.reconnects++
			}
			s.mu.Unlock()
			if refused { // as a connection refused: again 0.2 s later
				time.Sleep(200 * time.Millisecond)
			}
		}
	}
}

func (s *subscriber) has(seq int) bool { return seq < len(s.received) && s.received[seq] != 0 }

var okStatus = []byte("HTTP/1.1 200 ")

// read parses one response until it ends or the connection goes; false if it was not a
// subscription (a status other than 200: headers is not called).
func (s *subscriber) read(conn net.Conn, headers func()) bool {
	buf := make([]byte, 0, 64*1024)
	chunk := make([]byte, 32*1024)
	headersDone := false
	for {
		n, err := conn.Read(chunk)
		if n > 0 {
			at := now()
			buf = append(buf, chunk[:n]...)
			if !headersDone {
				end := bytes.Index(buf, []byte("\r\n\r\n"))
				if end < 0 {
					continue
				}
				headersDone = true
				if !bytes.HasPrefix(buf, okStatus) {
					return false
				}
				headers()
				buf = buf[end+4:]
			}
			i := 0
			s.mu.Lock()
			for {
				j := bytes.Index(buf[i:], seqMark)
				if j < 0 || i+j+13 > len(buf) {
					break
				}
				j += i
				seq, perr := strconv.Atoi(string(buf[j+4 : j+12]))
				if perr == nil && seq >= 0 && seq < 1<<24 {
					for seq >= len(s.received) {
						s.received = append(s.received, 0)
					}
					if s.received[seq] != 0 {
						s.duplicates++
					} else {
						s.received[seq] = at
						s.count++
					}
				}
				i = j + 13
			}
			if k := bytes.LastIndex(buf, offsetMark); k >= 0 {
				if end := bytes.IndexByte(buf[k+len(offsetMark):], '"'); end > 0 {
					s.offset = string(buf[k+len(offsetMark) : k+len(offsetMark)+end])
				}
			}
			s.mu.Unlock()
			ended := bytes.Contains(buf, lastChunk)
			keep := len(buf) - 64
			if i > keep {
				keep = i
			}
			if keep < 0 {
				keep = 0
			}
			buf = append(buf[:0], buf[keep:]...)
			if ended {
				return true
			}
		}
		if err != nil {
			return true
		}
	}
}

type times struct {
	Sent  map[string]float64 `json:"sent"`
	Acked map[string]float64 `json:"acked"`
}

type summary struct {
	Connected   int     `json:"connected"`
	P50         float64 `json:"p50_ms"`
	P99         float64 `json:"p99_ms"`
	Max         float64 `json:"max_ms"`
	AckP50      float64 `json:"ack_p50_ms"`
	AckP99      float64 `json:"ack_p99_ms"`
	Lost        int     `json:"lost"`
	Duplicated  int     `json:"duplicated"`
	Reconnects  int     `json:"reconnects"`
	MissingData int     `json:"subscribers_missing_data"`
	Refused     int     `json:"refused"`
	DrainedAt   float64 `json:"drained_at"`  // CLOCK_MONOTONIC seconds when deliveries had drained
	CPUSeconds  float64 `json:"cpu_seconds"` // this process's CPU (user + system) by then
}

// quantiles: p50, p99 and max in ms of arrival minus since, over every delivery of an acked seq.
func quantiles(subs []*subscriber, since, acked map[int]float64) (float64, float64, float64) {
	var values []float64
	for _, s := range subs {
		for seq, at := range s.received {
			if _, ok := acked[seq]; !ok || at == 0 {
				continue
			}
			v := (at - since[seq]) * 1000
			if v < 0 {
				v = 0
			}
			values = append(values, v)
		}
	}
	if len(values) == 0 {
		return -1, -1, -1
	}
	sort.Float64s(values)
	at := func(p float64) float64 {
		i := int(p * float64(len(values)))
		if i > len(values)-1 {
			i = len(values) - 1
		}
		return values[i]
	}
	return at(0.5), at(0.99), values[len(values)-1]
}

func byInt(m map[string]float64) map[int]float64 {
	out := make(map[int]float64, len(m))
	for k, v := range m {
		if n, err := strconv.Atoi(k); err == nil {
			out[n] = v
		}
	}
	return out
}

func main() {
	addr := flag.String("addr", "127.0.0.1:4437", "host:port")
	path := flag.String("path", "/v1/stream/x", "the stream's path")
	count := flag.Int("n", 1000, "subscribers")
	connectSeconds := flag.Float64("connect-seconds", 60, "how long to wait for every subscriber's first response")
	flag.Parse()
	origin, monoOrigin = time.Now(), monotonicNow()

	subs := make([]*subscriber, *count)
	stop := make(chan struct{})
	var connected int64
	connectBy := time.Now().Add(time.Duration(*connectSeconds * float64(time.Second)))
	for i := 0; i < len(subs); i += 250 { // in waves of 250, as fanout.py connects
		end := i + 250
		if end > len(subs) {
			end = len(subs)
		}
		var wave sync.WaitGroup
		for k := i; k < end; k++ {
			subs[k] = &subscriber{offset: "now"}
			wave.Add(1)
			go subs[k].run(*addr, *path, func(ok bool) {
				if ok {
					atomic.AddInt64(&connected, 1)
				}
				wave.Done()
			}, stop)
		}
		waved := make(chan struct{})
		go func() { wave.Wait(); close(waved) }()
		select { // every one has its headers (200), or gave up (50 attempts); as fanout.py waits
		case <-waved:
		case <-time.After(time.Until(connectBy)):
		}
	}
	out := bufio.NewWriter(os.Stdout)
	json.NewEncoder(out).Encode(map[string]int64{"ready": atomic.LoadInt64(&connected)})
	out.Flush()

	var t times
	if err := json.NewDecoder(bufio.NewReaderSize(os.Stdin, 1<<20)).Decode(&t); err != nil {
		fmt.Fprintln(os.Stderr, "ssegen: no times on stdin:", err)
		os.Exit(2)
	}
	sent, acked := byInt(t.Sent), byInt(t.Acked)
	// Let deliveries drain: every subscriber has every acked message, or 5 s without progress.
	total := func() int { // seqs received, acked or not (a sent one not acked is rare)
		n := 0
		for _, s := range subs {
			s.mu.Lock()
			n += s.count
			s.mu.Unlock()
		}
		return n
	}
	last, lastChange, deadline := -1, time.Now(), time.Now().Add(120*time.Second)
	for time.Now().Before(deadline) {
		got := total()
		if got >= len(acked)*len(subs) {
			break
		}
		if got != last {
			last, lastChange = got, time.Now()
		} else if time.Since(lastChange) > 5*time.Second {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	r := summary{DrainedAt: now()}
	var usage syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &usage) == nil {
		r.CPUSeconds = float64(usage.Utime.Nano()+usage.Stime.Nano()) / 1e9
	}
	close(stop)
	for _, s := range subs {
		s.mu.Lock() // kept: readers may still be parsing their last bytes, or reconnecting
		if s.conn != nil {
			s.conn.Close()
		}
	}
	r.Connected = int(atomic.LoadInt64(&connected))
	r.P50, r.P99, r.Max = quantiles(subs, sent, acked)
	r.AckP50, r.AckP99, _ = quantiles(subs, acked, acked)
	for _, s := range subs {
		missing := 0
		for seq := range acked {
			if !s.has(seq) {
				missing++
			}
		}
		r.Lost += missing
		if missing > 0 {
			r.MissingData++
		}
		r.Duplicated += s.duplicates
		r.Reconnects += s.reconnects
		r.Refused += s.refused
	}
	json.NewEncoder(out).Encode(r)
	out.Flush()
}
