// A userspace delay line between network namespaces, for benchmarks and slow tests
// (the kernels here have no netem qdisc). benchmarks/netem.py builds and drives it.
//
// One TUN device per node namespace, all held by this one process: every IPv4 packet a
// node sends to another node's address is read from the sender's TUN, passes
//
//   the sender's uplink    rate-limited FIFO, drop-tail at its queue limit
//   the pair's link        rate-limited FIFO, drop-tail; random loss; one-way delay
//                          (+ uniform jitter, never reordering a pair's packets)
//   the receiver's downlink rate-limited FIFO, drop-tail
//
// and is written into the receiver's TUN when it leaves the last stage. A rate of 0
// leaves a stage out. Rates count the bytes a link carries: the IP packet, and with
// segmentation offload (gso) every segment's own headers, as if the kernel had cut
// the super-packet into MTU-sized packets (TCP still sees MSS-sized segments: only
// this process handles 64 KiB units, so it can forward 10 Gbit/s on a small CPU).
// Random loss is per segment: a super-packet that loses some is cut into its segments
// and the others go on.
//
// The spec comes on stdin, one line per item, then "end":
//   config NODES GSO SEED
//   node I NETNS_PATH IPV4 UP_BITS DOWN_BITS UP_QUEUE_BYTES DOWN_QUEUE_BYTES
//   link I J RATE_BITS DELAY_NS JITTER_NS LOSS QUEUE_BYTES
//   end
// It prints "ready" once every TUN (named ptun0 in its namespace) exists; the caller
// then gives them addresses. Afterwards stdin takes "stats" (one JSON line back on
// stdout) and EOF ends the process (so does its parent's death).
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <linux/virtio_net.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_NODES 64
#define VNET_HDR ((int)sizeof(struct virtio_net_hdr))
#define MAX_PACKET (65536 + 64)
#define READ_BATCH 64

typedef struct Packet {
  struct Packet* next;  // free list
  int64_t t;            // when the next stage sees it
  uint32_t len;         // bytes in data (with the virtio header under gso)
  uint32_t wire;        // bytes it occupies on a link
  uint16_t dst;
  uint8_t data[];
} Packet;

typedef struct {
  int fd;
  uint32_t addr;           // network byte order
  double up_rate;          // bytes per ns, 0: unlimited
  double down_rate;
  double up_queue, down_queue;  // bytes
  int64_t up_busy, down_busy;   // when the queue drains (ns)
  uint64_t up_drops, down_drops;
} Node;

typedef struct {
  double rate;  // bytes per ns, 0: unlimited
  int64_t delay, jitter;
  double loss;
  double queue;
  int64_t busy;
  int64_t last;  // latest delivery time scheduled: no reordering
  uint64_t packets, bytes, queue_drops, loss_drops;  // loss_drops counts segments
} Link;

enum { ARRIVE_DOWN = 0, DELIVER = 1 };
typedef struct {
  int64_t t;
  uint64_t seq;
  Packet* p;
  int kind;
} Event;

static Node nodes[MAX_NODES];
static Link links[MAX_NODES][MAX_NODES];
static int n_nodes = 0;
static int gso = 0;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static Event* heap = NULL;
static size_t heap_len = 0, heap_cap = 0;
static uint64_t event_seq = 0;
static Packet* free_list = NULL;
static uint64_t delivered = 0, write_errors = 0, unroutable = 0;

static void die(const char* what) {
  fprintf(stderr, "prime-netem: %s: %s\n", what, strerror(errno));
  exit(1);
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double uniform01(void) {  // xorshift64*
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * 0x1p-53;
}

static Packet* packet_alloc(void) {
  Packet* p = free_list;
  if (p) {
    free_list = p->next;
    return p;
  }
  p = malloc(sizeof(Packet) + (gso ? MAX_PACKET : 2048));
  if (!p) die("malloc");
  return p;
}

static void packet_free(Packet* p) {
  p->next = free_list;
  free_list = p;
}

static int earlier(const Event* a, const Event* b) { return a->t < b->t || (a->t == b->t && a->seq < b->seq); }

static void heap_push(int64_t t, Packet* p, int kind) {
  if (heap_len == heap_cap) {
    heap_cap = heap_cap ? 2 * heap_cap : 4096;
    heap = realloc(heap, heap_cap * sizeof(Event));
    if (!heap) die("realloc");
  }
  size_t i = heap_len++;
  Event e = {t, event_seq++, p, kind};
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!earlier(&e, &heap[parent])) break;
    heap[i] = heap[parent];
    i = parent;
  }
  heap[i] = e;
}

static Event heap_pop(void) {
  Event top = heap[0];
  Event last = heap[--heap_len];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= heap_len) break;
    if (c + 1 < heap_len && earlier(&heap[c + 1], &heap[c])) ++c;
    if (!earlier(&heap[c], &last)) break;
    heap[i] = heap[c];
    i = c;
  }
  if (heap_len) heap[i] = last;
  return top;
}

// A rate-limited drop-tail FIFO seen at time t: returns when the packet leaves it, or -1
// when the queue is full (the bytes still waiting at t reach its limit). A packet is
// taken while the queue is below its limit, so it may pass it by one packet: with 64 KiB
// super-packets (gso) that is what a queue of MTU-sized packets would have taken of it,
// give or take the segments that would not have fit.
static int64_t fifo(double rate, double queue, int64_t* busy, int64_t t, uint32_t wire) {
  if (rate <= 0) return t;
  const int64_t start = *busy > t ? *busy : t;
  if ((double)(start - t) * rate >= queue) return -1;
  *busy = start + (int64_t)ceil(wire / rate);
  return *busy;
}

// Bytes on the link and the segment count of one packet (a gso super-packet counts as
// its segments, each with its own IP and TCP headers).
static void measure(const uint8_t* pkt, uint32_t len, const struct virtio_net_hdr* vh, uint32_t* wire,
                    uint32_t* segs) {
  *wire = len;
  *segs = 1;
  if (!vh || vh->gso_type == VIRTIO_NET_HDR_GSO_NONE || vh->gso_size == 0 || len < 20) return;
  uint32_t hdr = (uint32_t)(pkt[0] & 0x0F) * 4;
  if (hdr + 20 <= len && pkt[9] == 6) hdr += (uint32_t)(pkt[hdr + 12] >> 4) * 4;  // TCP
  if (hdr >= len) return;
  const uint32_t k = (len - hdr + vh->gso_size - 1) / vh->gso_size;
  *segs = k;
  *wire = len + (k - 1) * hdr;
}

static int route(const uint8_t* pkt, uint32_t len) {
  if (len < 20 || (pkt[0] >> 4) != 4) return -1;
  uint32_t dst;
  memcpy(&dst, pkt + 16, 4);
  for (int j = 0; j < n_nodes; ++j) {
    if (nodes[j].addr == dst) return j;
  }
  return -1;
}

static uint16_t checksum_fold(uint32_t sum) {
  while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
  return (uint16_t)sum;
}

static uint32_t sum_be16(const uint8_t* b, uint32_t n) {
  uint32_t sum = 0;
  for (uint32_t k = 0; k + 1 < n; k += 2) sum += (uint32_t)b[k] << 8 | b[k + 1];
  return sum;
}

// A gso super-packet (IPv4/TCP, partial checksum) cut into its MTU-sized segments, as the
// kernel would have sent them, without the segments marked lost; out[] gets the kept ones
// (each with a virtio header: no gso, the pseudo-header checksum to complete). Returns how
// many, or -1 when the packet is not one it can cut (then it is dropped whole).
static int cut_segments(const Packet* p, const uint8_t* lost, uint32_t segs, Packet** out) {
  const struct virtio_net_hdr* vh = (const struct virtio_net_hdr*)p->data;
  const uint8_t* ip = p->data + VNET_HDR;
  const uint32_t len = p->len - VNET_HDR;
  if (!(vh->flags & VIRTIO_NET_HDR_F_NEEDS_CSUM) || len < 40 || ip[9] != 6) return -1;
  const uint32_t ihl = (uint32_t)(ip[0] & 0x0F) * 4;
  const uint32_t thl = (uint32_t)(ip[ihl + 12] >> 4) * 4;
  const uint32_t hdr = ihl + thl, mss = vh->gso_size;
  if (hdr >= len || mss == 0) return -1;
  const uint32_t payload = len - hdr;
  uint32_t seq0;
  memcpy(&seq0, ip + ihl + 4, 4);
  seq0 = __builtin_bswap32(seq0);
  const uint16_t id0 = (uint16_t)(ip[4] << 8 | ip[5]);
  int n = 0;
  for (uint32_t k = 0; k < segs; ++k) {
    if (lost[k]) continue;
    const uint32_t plen = payload - k * mss < mss ? payload - k * mss : mss;
    Packet* q = packet_alloc();
    struct virtio_net_hdr* qh = (struct virtio_net_hdr*)q->data;
    memset(qh, 0, sizeof(*qh));
    qh->flags = VIRTIO_NET_HDR_F_NEEDS_CSUM;
    qh->gso_type = VIRTIO_NET_HDR_GSO_NONE;
    qh->hdr_len = (uint16_t)hdr;
    qh->csum_start = (uint16_t)ihl;
    qh->csum_offset = 16;
    uint8_t* qi = q->data + VNET_HDR;
    memcpy(qi, ip, hdr);
    memcpy(qi + hdr, ip + hdr + k * mss, plen);
    const uint32_t total = hdr + plen;
    qi[2] = (uint8_t)(total >> 8);
    qi[3] = (uint8_t)total;
    const uint16_t id = (uint16_t)(id0 + k);
    qi[4] = (uint8_t)(id >> 8);
    qi[5] = (uint8_t)id;
    qi[10] = qi[11] = 0;
    const uint16_t ipsum = (uint16_t)~checksum_fold(sum_be16(qi, ihl));
    qi[10] = (uint8_t)(ipsum >> 8);
    qi[11] = (uint8_t)ipsum;
    uint8_t* th = qi + ihl;
    const uint32_t seq = __builtin_bswap32(seq0 + k * mss);
    memcpy(th + 4, &seq, 4);
    if (k + 1 < segs) th[13] &= (uint8_t)~0x09;  // FIN and PSH only on the last segment
    if (k > 0) th[13] &= (uint8_t)~0x80;         // CWR only on the first
    // The pseudo-header sum (addresses, protocol, TCP length), for the receiver to complete.
    const uint32_t pseudo = sum_be16(qi + 12, 8) + 6 + (thl + plen);
    const uint16_t partial = checksum_fold(pseudo);
    th[16] = (uint8_t)(partial >> 8);
    th[17] = (uint8_t)partial;
    q->len = VNET_HDR + total;
    q->wire = total;
    out[n++] = q;
  }
  return n;
}

static void on_packet(int i, Packet* p, int64_t now) {
  const int off = gso ? VNET_HDR : 0;
  const uint8_t* pkt = p->data + off;
  const uint32_t len = p->len - off;
  const int j = route(pkt, len);
  if (j < 0 || j == i) {
    ++unroutable;
    packet_free(p);
    return;
  }
  uint32_t segs;
  measure(pkt, len, gso ? (const struct virtio_net_hdr*)p->data : NULL, &p->wire, &segs);
  Node* a = &nodes[i];
  Link* l = &links[i][j];
  int64_t t = fifo(a->up_rate, a->up_queue, &a->up_busy, now, p->wire);
  if (t < 0) {
    ++a->up_drops;
    packet_free(p);
    return;
  }
  t = fifo(l->rate, l->queue, &l->busy, t, p->wire);
  if (t < 0) {
    ++l->queue_drops;
    packet_free(p);
    return;
  }
  t += l->delay;
  if (l->jitter > 0) t += (int64_t)(uniform01() * (double)l->jitter);
  if (t < l->last) t = l->last;
  const int kind = nodes[j].down_rate > 0 ? ARRIVE_DOWN : DELIVER;
  if (l->loss > 0) {
    // Every segment is lost on its own with the link's probability; a super-packet that
    // lost some but not all of them goes on as the segments that were not lost.
    uint8_t lost[64] = {0};
    uint32_t n_lost = 0;
    const uint32_t n = segs < 64 ? segs : 64;
    for (uint32_t k = 0; k < n; ++k) n_lost += lost[k] = uniform01() < l->loss;
    l->loss_drops += n_lost;
    if (n_lost == n) {
      packet_free(p);
      return;
    }
    if (n_lost > 0) {
      Packet* kept[64];
      const int m = gso && segs > 1 && segs <= 64 ? cut_segments(p, lost, segs, kept) : -1;
      packet_free(p);
      for (int k = 0; k < m; ++k) {
        ++l->packets;
        l->bytes += kept[k]->wire;
        kept[k]->dst = (uint16_t)j;
        kept[k]->t = t;
        heap_push(t, kept[k], kind);
      }
      l->last = t;
      return;
    }
  }
  l->last = t;
  ++l->packets;
  l->bytes += p->wire;
  p->dst = (uint16_t)j;
  p->t = t;
  heap_push(t, p, kind);
}

static void on_event(Event e) {
  Packet* p = e.p;
  Node* b = &nodes[p->dst];
  if (e.kind == ARRIVE_DOWN) {
    const int64_t t = fifo(b->down_rate, b->down_queue, &b->down_busy, e.t, p->wire);
    if (t < 0) {
      ++b->down_drops;
      packet_free(p);
      return;
    }
    heap_push(t, p, DELIVER);
    return;
  }
  if (write(b->fd, p->data, p->len) < 0) ++write_errors;  // the namespace went away, or a full queue
  ++delivered;
  packet_free(p);
}

static void print_stats(void) {
  printf("{\"delivered\": %llu, \"write_errors\": %llu, \"unroutable\": %llu, \"queued\": %zu, \"nodes\": [",
         (unsigned long long)delivered, (unsigned long long)write_errors, (unsigned long long)unroutable, heap_len);
  for (int i = 0; i < n_nodes; ++i) {
    printf("%s{\"up_drops\": %llu, \"down_drops\": %llu}", i ? ", " : "", (unsigned long long)nodes[i].up_drops,
           (unsigned long long)nodes[i].down_drops);
  }
  printf("], \"links\": [");
  int first = 1;
  for (int i = 0; i < n_nodes; ++i) {
    for (int j = 0; j < n_nodes; ++j) {
      const Link* l = &links[i][j];
      if (i == j || (!l->packets && !l->queue_drops && !l->loss_drops)) continue;
      printf("%s{\"src\": %d, \"dst\": %d, \"packets\": %llu, \"bytes\": %llu, \"queue_drops\": %llu, "
             "\"loss_drops\": %llu}",
             first ? "" : ", ", i, j, (unsigned long long)l->packets, (unsigned long long)l->bytes,
             (unsigned long long)l->queue_drops, (unsigned long long)l->loss_drops);
      first = 0;
    }
  }
  printf("]}\n");
  fflush(stdout);
}

static int open_tun(const char* netns_path) {
  const int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  const int target = open(netns_path, O_RDONLY | O_CLOEXEC);
  if (home < 0 || target < 0) die(netns_path);
  if (setns(target, CLONE_NEWNET) != 0) die("setns");
  const int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) die("/dev/net/tun");
  struct ifreq ifr;
  memset(&ifr, 0, sizeof(ifr));
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (gso ? IFF_VNET_HDR : 0);
  strncpy(ifr.ifr_name, "ptun0", IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) die("TUNSETIFF");
  if (gso) {
    int hdr = VNET_HDR;
    if (ioctl(fd, TUNSETVNETHDRSZ, &hdr) != 0) die("TUNSETVNETHDRSZ");
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) != 0) die("TUNSETOFFLOAD");
  }
  if (setns(home, CLONE_NEWNET) != 0) die("setns (back)");
  close(home);
  close(target);
  return fd;
}

static double bits_to_bytes_per_ns(double bits) { return bits > 0 ? bits / 8e9 : 0; }

static void read_spec(void) {
  char line[4096];
  unsigned long long seed = 1;
  while (fgets(line, sizeof(line), stdin)) {
    int i, j;
    if (strncmp(line, "end", 3) == 0) return;
    if (sscanf(line, "config %d %d %llu", &n_nodes, &gso, &seed) == 3) {
      if (n_nodes < 2 || n_nodes > MAX_NODES) {
        fprintf(stderr, "prime-netem: %d nodes (2 to %d)\n", n_nodes, MAX_NODES);
        exit(2);
      }
      rng_state ^= seed * 0xD1B54A32D192ED03ull;
      continue;
    }
    char path[1024], addr[64];
    double up, down, upq, downq;
    if (sscanf(line, "node %d %1023s %63s %lf %lf %lf %lf", &i, path, addr, &up, &down, &upq, &downq) == 7) {
      if (i < 0 || i >= n_nodes) {
        fprintf(stderr, "prime-netem: node %d out of range\n", i);
        exit(2);
      }
      unsigned a, b, c, d;
      if (sscanf(addr, "%u.%u.%u.%u", &a, &b, &c, &d) != 4) {
        fprintf(stderr, "prime-netem: bad address %s\n", addr);
        exit(2);
      }
      const uint8_t bytes[4] = {(uint8_t)a, (uint8_t)b, (uint8_t)c, (uint8_t)d};
      memcpy(&nodes[i].addr, bytes, 4);
      nodes[i].up_rate = bits_to_bytes_per_ns(up);
      nodes[i].down_rate = bits_to_bytes_per_ns(down);
      nodes[i].up_queue = upq;
      nodes[i].down_queue = downq;
      nodes[i].fd = open_tun(path);
      continue;
    }
    double rate, loss, queue;
    long long delay, jitter;
    if (sscanf(line, "link %d %d %lf %lld %lld %lf %lf", &i, &j, &rate, &delay, &jitter, &loss, &queue) == 7) {
      if (i < 0 || i >= n_nodes || j < 0 || j >= n_nodes) {
        fprintf(stderr, "prime-netem: link %d %d out of range\n", i, j);
        exit(2);
      }
      links[i][j].rate = bits_to_bytes_per_ns(rate);
      links[i][j].delay = delay;
      links[i][j].jitter = jitter;
      links[i][j].loss = loss;
      links[i][j].queue = queue;
      continue;
    }
    fprintf(stderr, "prime-netem: cannot parse spec line: %s", line);
    exit(2);
  }
  fprintf(stderr, "prime-netem: the spec ended without 'end'\n");
  exit(2);
}

int main(void) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  prctl(PR_SET_TIMERSLACK, 1);  // wake within a microsecond of the next departure
  read_spec();
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  for (int i = 0; i < n_nodes; ++i) {
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, nodes[i].fd, &ev) != 0) die("epoll_ctl");
  }
  struct epoll_event ctl = {.events = EPOLLIN, .data.u32 = 0xFFFFFFFFu};
  if (epoll_ctl(ep, EPOLL_CTL_ADD, STDIN_FILENO, &ctl) != 0) die("epoll_ctl (stdin)");
  printf("ready\n");
  fflush(stdout);
  struct epoll_event events[MAX_NODES + 1];
  for (;;) {
    int64_t now = now_ns();
    while (heap_len && heap[0].t <= now) on_event(heap_pop());
    struct timespec timeout, *tp = NULL;
    if (heap_len) {
      const int64_t wait = heap[0].t - now;
      timeout.tv_sec = wait / 1000000000;
      timeout.tv_nsec = wait % 1000000000;
      tp = &timeout;
    }
    const int k = epoll_pwait2(ep, events, MAX_NODES + 1, tp, NULL);
    if (k < 0) {
      if (errno == EINTR) continue;
      die("epoll_pwait2");
    }
    now = now_ns();
    for (int e = 0; e < k; ++e) {
      const uint32_t i = events[e].data.u32;
      if (i == 0xFFFFFFFFu) {
        char cmd[256];
        const ssize_t got = read(STDIN_FILENO, cmd, sizeof(cmd) - 1);
        if (got == 0) return 0;  // the parent is gone
        if (got < 0) continue;
        cmd[got] = 0;
        for (const char* c = cmd; (c = strstr(c, "stats")) != NULL; c += 5) print_stats();
        continue;
      }
      for (int r = 0; r < READ_BATCH; ++r) {
        Packet* p = packet_alloc();
        const ssize_t got = read(nodes[i].fd, p->data, gso ? MAX_PACKET : 2048);
        if (got <= 0) {
          packet_free(p);
          if (got < 0 && errno != EAGAIN && errno != EINTR) die("read (tun)");
          break;
        }
        p->len = (uint32_t)got;
        on_packet((int)i, p, now);
      }
    }
  }
}
