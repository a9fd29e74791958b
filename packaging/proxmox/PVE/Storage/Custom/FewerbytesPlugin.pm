package PVE::Storage::Custom::FewerbytesPlugin;

# A Proxmox VE storage of type `fewerbytes`: VM disks as volumes of a fewerbytes pool,
# served over NBD by `fewerbytes serve` (the fewerbytes@NAME service).
#
# Every operation runs the `fewerbytes` command with --require-server, so it reaches
# the running server through its control socket and never opens the pool itself; QEMU
# opens each disk as the NBD export of its volume (`path` returns the URI, pve-storage
# turns it into an `nbd` blockdev). docs/proxmox.md says what each action does to the
# pool and what is refused.
#
# Names: a Proxmox volume name is the pool volume's name, except that a linked clone's
# volume name `base-100-disk-0/vm-101-disk-0` (its template, then itself, as Proxmox
# wants it) is stored as `base-100-disk-0+vm-101-disk-0`: a pool volume name has no
# `/`, and the template's name must survive in the pool for Proxmox to refuse deleting
# a template that clones still name. A snapshot SNAP of a volume is the pool volume
# `snap:SNAP:VOLUME`, a clone taken at that moment.
#
# A pool on a Ceph RBD image (`rbd:POOL/IMAGE[@CLUSTER]`) is reachable from every node,
# so such a storage is `shared` (set when it is added); one node serves it at a time
# (docs/proxmox.md, "A pool on RBD: shared storage"). It has no directory to keep
# sockets beside, so its storage must name the sockets of the server that serves it.

use strict;
use warnings;

use JSON;
use POSIX qw(ceil);

use PVE::Tools qw(run_command);
use PVE::Storage::Plugin;

use base qw(PVE::Storage::Plugin);

# The binary the install script puts in place; the tests point this at their build.
our $FEWERBYTES = '/usr/local/bin/fewerbytes';

# A volume's size must be a multiple of the pool's 4 KiB block.
my $BLOCK_BYTES = 4096;

# How long one management command may take: volume commands take a checkpoint, and
# `volume list` walks every block map.
my $COMMAND_TIMEOUT_S = 120;

# What the plugin was written and tested against: pve-storage's storage API 15
# (APIAGE 6, so hosts from API 9 on load it). On an older host, claim its version: the
# methods used here exist since API 10 (rename_volume), and a newer API only adds.
my $API_TESTED = 15;
my $API_MIN = 10;

sub api {
    # Looked up when called: PVE::Storage loads this plugin, so it may not be compiled
    # yet when this file is.
    my $apiver = PVE::Storage->can('APIVER');
    my $host = $apiver ? $apiver->() : $API_TESTED;
    return $API_TESTED if $host >= $API_TESTED;
    return $host >= $API_MIN ? $host : $API_TESTED;
}

sub type {
    return 'fewerbytes';
}

sub plugindata {
    return {
        # Disk images only. Containers (rootdir) need a block device or a file system on
        # the host, and a volume here is an NBD export that only QEMU opens.
        content => [{ images => 1 }, { images => 1 }],
        format => [{ raw => 1 }, 'raw'],
    };
}

sub properties {
    return {
        'fewerbytes-pool' => {
            description => "The fewerbytes pool (file, block device or rbd:POOL/IMAGE"
                . " image) this storage keeps its disks in, as the server was started with.",
            type => 'string',
        },
        'fewerbytes-socket' => {
            description => "The server's NBD unix socket (default: <pool>.sock, for a pool"
                . " file; /run/fewerbytes/NAME.sock for the fewerbytes\@NAME service;"
                . " required for a pool on RBD).",
            type => 'string',
        },
        'fewerbytes-control-socket' => {
            description => "The server's control socket (default: <pool>.ctl, for a pool"
                . " file; /run/fewerbytes/NAME.ctl for the fewerbytes\@NAME service;"
                . " required for a pool on RBD).",
            type => 'string',
        },
    };
}

sub options {
    return {
        'fewerbytes-pool' => { fixed => 1 },
        'fewerbytes-socket' => { optional => 1 },
        'fewerbytes-control-socket' => { optional => 1 },
        nodes => { optional => 1 },
        shared => { optional => 1 },
        disable => { optional => 1 },
        content => { optional => 1 },
        bwlimit => { optional => 1 },
    };
}

# ---------------------------------------------------------------------------------
# Talking to the server

# Whether the pool is on a Ceph RBD image (`rbd:POOL/IMAGE[@CLUSTER]`, the scheme as
# the fewerbytes CLI reads it): every node of the cluster can reach it.
my sub is_rbd_pool {
    my ($scfg) = @_;
    return ($scfg->{'fewerbytes-pool'} // '') =~ m/^rbd:/ ? 1 : 0;
}

# The sockets of a pool on RBD are where its server was told to put them: the CLI's
# own default, /run/fewerbytes/<pool id>.*, is not what the fewerbytes@NAME service
# uses, and there is no directory beside an image. So they must be named: the
# sentence saying so, or undef when they are (or the pool is a file).
my sub rbd_sockets_missing {
    my ($scfg) = @_;
    return undef if !is_rbd_pool($scfg);
    my @missing = grep { ($scfg->{$_} // '') eq '' } qw(fewerbytes-socket fewerbytes-control-socket);
    return undef if !@missing;
    return "pool $scfg->{'fewerbytes-pool'} is on RBD, with no directory to find its"
        . " server's sockets in: set " . join(' and ', @missing) . " (for the"
        . " fewerbytes\@NAME service that serves it: /run/fewerbytes/NAME.sock and"
        . " /run/fewerbytes/NAME.ctl)\n";
}

my sub control_socket {
    my ($scfg) = @_;
    if (my $missing = rbd_sockets_missing($scfg)) {
        die $missing;
    }
    return $scfg->{'fewerbytes-control-socket'} // "$scfg->{'fewerbytes-pool'}.ctl";
}

my sub nbd_socket {
    my ($scfg) = @_;
    if (my $missing = rbd_sockets_missing($scfg)) {
        die $missing;
    }
    return $scfg->{'fewerbytes-socket'} // "$scfg->{'fewerbytes-pool'}.sock";
}

# Run `fewerbytes ARGS` against the storage's served pool; returns its stdout. Dies
# with the command's own sentence (it names the volume, the numbers, the reason).
my sub fewerbytes {
    my ($scfg, @args) = @_;
    die "storage has no fewerbytes-pool\n" if !$scfg->{'fewerbytes-pool'};
    my $cmd = [
        $FEWERBYTES,
        '--pool', $scfg->{'fewerbytes-pool'},
        '--control-socket', control_socket($scfg),
        '--require-server',
        @args,
    ];
    my ($out, $err) = ('', '');
    eval {
        run_command(
            $cmd,
            outfunc => sub { $out .= "$_[0]\n" },
            errfunc => sub { $err .= "$_[0]\n" },
            timeout => $COMMAND_TIMEOUT_S,
        );
    };
    if (my $failed = $@) {
        # Under systemd the CLI prefixes errors with the journal's level (<3>).
        $err =~ s/^<\d>//mg;
        $err =~ s/^fewerbytes: error: //mg;
        $err =~ s/\s+\z//;
        die $err ne '' ? "$err\n" : $failed;
    }
    return $out;
}

my sub fewerbytes_json {
    my ($scfg, @args) = @_;
    return decode_json(fewerbytes($scfg, @args, '--json'));
}

# Every pool volume, by pool name.
my sub pool_volumes {
    my ($scfg) = @_;
    return { map { $_->{name} => $_ } fewerbytes_json($scfg, 'volume', 'list')->@* };
}

# ---------------------------------------------------------------------------------
# Names

# The pool volume holding a Proxmox volume (or one of its snapshots).
my sub pool_name {
    my ($volname, $snap) = @_;
    my $name = $volname =~ s|/|+|r;
    return defined($snap) ? "snap:$snap:$name" : $name;
}

# The characters Proxmox may use in a disk name here: those of a pool volume name
# except `+` and `:`, which the plugin's own names use.
my $NAME_RE = qr/[A-Za-z0-9][A-Za-z0-9_.-]*/;

sub parse_volname {
    my ($class, $volname) = @_;

    if ($volname =~ m!^(?:(base-(\d+)-$NAME_RE)/)?((vm-|base-)(\d+)-$NAME_RE)$!) {
        my ($basename, $basevmid, $name, $prefix, $vmid) = ($1, $2, $3, $4, $5);
        my $is_base = $prefix eq 'base-' ? 1 : undef;
        return ('images', $name, $vmid, $basename, $basevmid, $is_base, 'raw');
    }
    die "unable to parse fewerbytes volume name '$volname'\n";
}

# The Proxmox volume name of a pool volume, or undef for what is not a disk here
# (snapshots, volumes made by hand).
my sub volname_of {
    my ($pool_name) = @_;
    return undef if $pool_name =~ /^snap:/;
    my $volname = $pool_name =~ s|\+|/|r;
    return eval { PVE::Storage::Custom::FewerbytesPlugin->parse_volname($volname); 1 }
        ? $volname
        : undef;
}

# The first free `vm-VMID-disk-N` among the pool's volumes.
my sub free_disk_name {
    my ($scfg, $storeid, $vmid, $volumes) = @_;
    my %taken;
    for my $pool_name (keys %$volumes) {
        my $volname = volname_of($pool_name) // next;
        my $name = (PVE::Storage::Custom::FewerbytesPlugin->parse_volname($volname))[1];
        $taken{$1} = 1 if $name =~ m/^(?:vm|base)-\Q$vmid\E-disk-(\d+)$/;
    }
    for my $n (0 .. 999) {
        return "vm-$vmid-disk-$n" if !$taken{$n};
    }
    die "unable to allocate a disk name for VM $vmid on storage '$storeid'\n";
}

# Bytes rounded up to the pool's block size.
my sub whole_blocks {
    my ($bytes) = @_;
    return ceil($bytes / $BLOCK_BYTES) * $BLOCK_BYTES;
}

# ---------------------------------------------------------------------------------
# Storage

sub on_add_hook {
    my ($class, $storeid, $scfg, %param) = @_;
    die "storage '$storeid': a fewerbytes storage holds VM disk images only; containers"
        . " (rootdir) need a block device or file system on the host, which an NBD"
        . " export served to QEMU is not\n"
        if $scfg->{content} && $scfg->{content}->{rootdir};
    if (my $missing = rbd_sockets_missing($scfg)) {
        die "storage '$storeid': $missing";
    }
    # A pool on RBD is the same pool from every node: Proxmox must know, to restart
    # or move a VM on another node without copying its disks. pve-storage stores the
    # options this hook is given, so the flag is kept in storage.cfg. A pool file
    # stays as the admin said (a block device shared by other means may be `shared`).
    $scfg->{shared} = 1 if is_rbd_pool($scfg);
    return undef;
}

# `pvesm set` (storage API 13 on: the current config, the changed options and the
# deleted ones). A pool on RBD keeps its sockets and stays shared.
sub on_update_hook_full {
    my ($class, $storeid, $scfg, $param, $delete, $sensitive) = @_;
    my %after = (%$scfg, %$param);
    delete $after{$_} for ($delete // [])->@*;
    return undef if !is_rbd_pool(\%after);
    if (my $missing = rbd_sockets_missing(\%after)) {
        die "storage '$storeid': $missing";
    }
    die "storage '$storeid': pool $after{'fewerbytes-pool'} is on RBD, the same pool from"
        . " every node: it stays shared\n"
        if !$after{shared};
    return undef;
}

sub status {
    my ($class, $storeid, $scfg, $cache) = @_;
    my $stats = eval { fewerbytes_json($scfg, 'stats') };
    if (my $err = $@) {
        warn "storage '$storeid': $err";
        return (0, 0, 0, 0);
    }
    # Disks made here are thick (alloc_image and clone_image run `volume create` and
    # `volume clone`, which reserve the disk's size), so what Proxmox may still put
    # here is what a new reservation can get: avail is the pool's Reservable, and
    # used the rest of its Size, so that used + avail = total as Proxmox adds them
    # (docs/proxmox.md). Stats' Available (what a thin write can take) is larger by
    # the reserve kept for trims and deletes and a new reservation's metadata pages.
    my $total = $stats->{size_bytes};
    my $avail = $stats->{reservable_bytes};
    die "fewerbytes stats --json gave no size_bytes or reservable_bytes\n"
        if !defined($total) || !defined($avail);
    return ($total, $avail, $total - $avail, 1);
}

sub activate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    eval { fewerbytes($scfg, 'pool', 'info', '--json') };
    die "storage '$storeid' is not available: $@" if $@;
    return 1;
}

sub deactivate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    return 1;
}

sub check_connection {
    my ($class, $storeid, $scfg) = @_;
    return eval { fewerbytes($scfg, 'pool', 'info', '--json'); 1 } ? 1 : 0;
}

# ---------------------------------------------------------------------------------
# Volumes

sub path {
    my ($class, $scfg, $volname, $storeid, $snapname) = @_;
    my ($vtype, undef, $vmid) = $class->parse_volname($volname);
    my $path = 'nbd+unix:///' . pool_name($volname, $snapname) . '?socket=' . nbd_socket($scfg);
    return wantarray ? ($path, $vmid, $vtype) : $path;
}

sub filesystem_path {
    my ($class, $scfg, $volname, $snapname) = @_;
    return $class->path($scfg, $volname, undef, $snapname);
}

sub map_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $hints) = @_;
    die "volume '$storeid:$volname' cannot be mapped to a block device on the host: a"
        . " fewerbytes volume is an NBD export that QEMU opens (containers, and TPM state,"
        . " which swtpm needs as a file, are not supported here)\n";
}

sub unmap_volume {
    my ($class, $storeid, $scfg, $volname, $snapname) = @_;
    return 1;
}

sub activate_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $cache, $hints) = @_;
    my $name = pool_name($volname, $snapname);
    eval { fewerbytes($scfg, 'volume', 'info', $name, '--json') };
    die "volume '$storeid:$volname' is not available: $@" if $@;
    return 1;
}

sub deactivate_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $cache) = @_;
    return 1;
}

sub alloc_image {
    my ($class, $storeid, $scfg, $vmid, $fmt, $name, $size_kib) = @_;

    die "a fewerbytes storage holds raw disk images only, not '$fmt'"
        . ($fmt eq 'subvol' ? ' (containers are not supported)' : '') . "\n"
        if $fmt ne 'raw';
    die "illegal name '$name' - should be 'vm-$vmid-*'\n"
        if defined($name) && $name !~ m/^vm-\Q$vmid\E-$NAME_RE$/;
    die "a disk of size 0 cannot be created\n" if !$size_kib;

    $name //= free_disk_name($scfg, $storeid, $vmid, pool_volumes($scfg));
    fewerbytes($scfg, 'volume', 'create', $name, '--size', whole_blocks($size_kib * 1024));
    return $name;
}

sub free_image {
    my ($class, $storeid, $scfg, $volname, $is_base, $format) = @_;
    my $name = pool_name($volname);
    # Refused while a VM has the disk open (the server counts its connections).
    fewerbytes($scfg, 'volume', 'delete', $name);
    # Its snapshots go with it, as a file's internal snapshots would.
    for my $pool_name (sort keys pool_volumes($scfg)->%*) {
        next if $pool_name !~ m/^snap:[^:]+:\Q$name\E$/;
        fewerbytes($scfg, 'volume', 'delete', $pool_name);
    }
    return undef;
}

sub list_images {
    my ($class, $storeid, $scfg, $vmid, $vollist, $cache) = @_;
    my $volumes = pool_volumes($scfg);
    my %wanted = map { $_ => 1 } ($vollist // [])->@*;
    my $res = [];
    for my $pool_name (sort keys %$volumes) {
        my $volname = volname_of($pool_name) // next;
        my (undef, undef, $owner, $basename) = $class->parse_volname($volname);
        my $volid = "$storeid:$volname";
        if ($vollist) {
            next if !$wanted{$volid};
        } elsif (defined($vmid)) {
            next if $owner ne $vmid;
        }
        my $volume = $volumes->{$pool_name};
        push @$res,
            {
                volid => $volid,
                format => 'raw',
                size => $volume->{size_bytes},
                used => $volume->{logical_used_bytes},
                vmid => $owner,
                (defined($basename) ? (parent => $basename) : ()),
            };
    }
    return $res;
}

sub volume_size_info {
    my ($class, $scfg, $storeid, $volname, $timeout) = @_;
    my (undef, undef, undef, $basename) = $class->parse_volname($volname);
    my $volume = fewerbytes_json($scfg, 'volume', 'info', pool_name($volname));
    return $volume->{size_bytes} if !wantarray;
    return ($volume->{size_bytes}, 'raw', $volume->{logical_used_bytes}, $basename);
}

sub volume_resize {
    my ($class, $scfg, $storeid, $volname, $size, $running, $snapname) = @_;
    die "cannot resize '$storeid:$volname' while its VM runs: QEMU cannot resize an NBD"
        . " disk live; shut the VM down, resize, and start it again\n"
        if $running;
    die "cannot resize a snapshot of '$storeid:$volname'\n" if defined($snapname);
    fewerbytes($scfg, 'volume', 'resize', pool_name($volname), '--size', whole_blocks($size));
    return undef;
}

sub create_base {
    my ($class, $storeid, $scfg, $volname) = @_;
    my ($vtype, $name, $vmid, $basename, $basevmid, $is_base) = $class->parse_volname($volname);
    die "create_base not possible with base image\n" if $is_base;
    my $pool_name = pool_name($volname);
    die "cannot make a template of '$storeid:$volname' while it has snapshots: delete them"
        . " first\n"
        if grep { m/^snap:[^:]+:\Q$pool_name\E$/ } keys pool_volumes($scfg)->%*;

    (my $newname = $name) =~ s/^vm-/base-/;
    my $newvolname = defined($basename) ? "$basename/$newname" : $newname;
    fewerbytes($scfg, 'volume', 'rename', $pool_name, pool_name($newvolname));
    return $newvolname;
}

sub clone_image {
    my ($class, $scfg, $storeid, $volname, $vmid, $snap) = @_;
    my ($vtype, $name, undef, undef, undef, $is_base) = $class->parse_volname($volname);
    die "a linked clone of a snapshot is not supported on fewerbytes: make a full clone\n"
        if $snap;
    die "clone_image only works on base images\n" if !$is_base;

    my $newname = free_disk_name($scfg, $storeid, $vmid, pool_volumes($scfg));
    my $newvolname = "$name/$newname";
    fewerbytes($scfg, 'volume', 'clone', pool_name($volname), pool_name($newvolname));
    return $newvolname;
}

sub rename_volume {
    my ($class, $scfg, $storeid, $source_volname, $target_vmid, $target_volname) = @_;
    my (undef, undef, undef, $basename) = $class->parse_volname($source_volname);
    $target_volname //= free_disk_name($scfg, $storeid, $target_vmid, pool_volumes($scfg));
    die "illegal name '$target_volname' - should be 'vm-$target_vmid-*'\n"
        if $target_volname !~ m/^vm-\Q$target_vmid\E-$NAME_RE$/;
    my $target = defined($basename) ? "$basename/$target_volname" : $target_volname;
    fewerbytes($scfg, 'volume', 'rename', pool_name($source_volname), pool_name($target));
    return "$storeid:$target";
}

# ---------------------------------------------------------------------------------
# Snapshots: a snapshot is a clone of the volume at that moment (it shares every
# block, and costs the volume's size in what a thick pool can address).

sub volume_snapshot {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    fewerbytes($scfg, 'volume', 'clone', pool_name($volname), pool_name($volname, $snap));
    return undef;
}

sub volume_snapshot_delete {
    my ($class, $scfg, $storeid, $volname, $snap, $running) = @_;
    fewerbytes($scfg, 'volume', 'delete', pool_name($volname, $snap));
    return undef;
}

sub volume_snapshot_rollback {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    my $name = pool_name($volname);
    my $snapshot = pool_name($volname, $snap);
    my $volumes = pool_volumes($scfg);
    die "snapshot '$snap' of '$storeid:$volname' does not exist\n" if !$volumes->{$snapshot};
    # One durable step (a crash leaves the disk as it was or as the snapshot), refused
    # while a VM has the disk open; the snapshot stays.
    fewerbytes($scfg, 'volume', 'rollback', $name, $snapshot);
    return undef;
}

# ---------------------------------------------------------------------------------
# Export and import (`pvesm export`/`import`, which offline migration and
# `storage_migrate` pipe from one node to the other). Two formats, the first the one
# pve-storage picks between two fewerbytes storages (it takes the first format both
# sides offer):
#
# - `fewerbytes`: the disk (and, when asked, its snapshots) as fewerbytes send
#   streams (docs/stream.md), run by the servers: each distinct block crosses once,
#   zeros as runs, each snapshot as an increment from the one before, and an export
#   from a snapshot both sides hold (`$base_snapshot`) carries only what changed.
# - `raw+size`: the disk's size as a little-endian u64, then its bytes, read and
#   written over NBD (`nbdcopy`): what other storage types export and import. The
#   plugin counts the bytes, so a stream cut short fails the import (and removes the
#   half-written disk) instead of leaving zeros.
#
# A `fewerbytes` export is a sequence of parts, one send stream each:
#
#   "fewerbytes-pve 1\n"
#   for each part: "part " JSON "\n", then the stream in chunks (a u32 big-endian
#       length, then that many bytes), a length of 0 ending it
#   "end\n"
#
# A part's JSON says what it becomes, {"snapshot": SNAP} a snapshot or {"snapshot":
# null} the disk itself, and {"base": SNAP} (or null) the snapshot it is an
# increment from: the importer names its own copy of it (`volume receive --from`),
# and the stream's base digest refuses a base that is not the sender's.

my $STREAM_CHUNK = 1024 * 1024;

# Our format's name. pve-storage's `pvesm export` and `pvesm import` take only the
# formats in $PVE::Storage::KNOWN_EXPORT_FORMATS (their `format` parameter is an enum
# of that array, checked when they run), so the plugin adds its own to it when
# pve-storage loads it.
my $STREAM_FORMAT = 'fewerbytes';
if (my $known = do { no warnings 'once'; $PVE::Storage::KNOWN_EXPORT_FORMATS }) {
    push @$known, $STREAM_FORMAT if !grep { $_ eq $STREAM_FORMAT } @$known;
}
my $CONTAINER_MAGIC = "fewerbytes-pve 1\n";

# Copy exactly $size bytes from $from to $to (file handles), dying with $what if the
# source ends early or holds more.
my sub copy_exactly {
    my ($from, $to, $size, $what) = @_;
    my $copied = 0;
    while (1) {
        my $n = sysread($from, my $chunk, $STREAM_CHUNK);
        die "$what: read failed: $!\n" if !defined($n);
        last if $n == 0;
        $copied += $n;
        die "$what: more than the $size bytes the stream's header announced\n"
            if $copied > $size;
        my $off = 0;
        while ($off < $n) {
            my $w = syswrite($to, $chunk, $n - $off, $off);
            die "$what: write failed: $!\n" if !defined($w);
            $off += $w;
        }
    }
    die "$what: the stream ended after $copied of $size bytes\n" if $copied != $size;
}

my sub write_all {
    my ($fh, $bytes, $what) = @_;
    my $off = 0;
    while ($off < length($bytes)) {
        my $w = syswrite($fh, $bytes, length($bytes) - $off, $off);
        die "$what: write failed: $!\n" if !defined($w);
        $off += $w;
    }
}

# Exactly $len bytes from $fh, or die naming $what.
my sub read_exactly {
    my ($fh, $len, $what) = @_;
    my $bytes = '';
    while (length($bytes) < $len) {
        my $n = sysread($fh, $bytes, $len - length($bytes), length($bytes));
        die "$what: read failed: $!\n" if !defined($n);
        die "$what: the stream ended early\n" if $n == 0;
    }
    return $bytes;
}

# One line (up to "\n", at most 4 KiB) from $fh, a byte at a time: what follows it
# is chunked stream bytes, which must stay unread.
my sub read_line {
    my ($fh, $what) = @_;
    my $line = '';
    while ($line !~ /\n\z/) {
        die "$what: the stream is damaged (a header line past 4 KiB)\n" if length($line) > 4096;
        $line .= read_exactly($fh, 1, $what);
    }
    return $line;
}

# The snapshots of pool volume $name, oldest first: the pool volumes
# `snap:SNAP:NAME`, in the order they were made (a pool's volume ids grow).
my sub snapshots_of {
    my ($volumes, $name) = @_;
    my @snaps;
    for my $pool_name (keys %$volumes) {
        push @snaps, [$1, $volumes->{$pool_name}->{id}]
            if $pool_name =~ m/^snap:([^:]+):\Q$name\E$/;
    }
    return map { $_->[0] } sort { $a->[1] <=> $b->[1] } @snaps;
}

# `fewerbytes ARGS` as the plugin's other commands run it, for a pipe.
my sub fewerbytes_command {
    my ($scfg, @args) = @_;
    die "storage has no fewerbytes-pool\n" if !$scfg->{'fewerbytes-pool'};
    return (
        $FEWERBYTES,
        '--pool', $scfg->{'fewerbytes-pool'},
        '--control-socket', control_socket($scfg),
        '--require-server',
        @args,
    );
}

# The parts an export of $volname sends, in order: [snapshot or undef (the disk),
# base snapshot or undef (a full stream)] each.
my sub export_parts {
    my ($scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my $name = pool_name($volname);
    my $volumes = pool_volumes($scfg);
    die "volume '$storeid:$volname' does not exist\n" if !$volumes->{$name};
    my @snaps = snapshots_of($volumes, $name);
    for my $snap (grep { defined } $snapshot, $base_snapshot) {
        die "snapshot '$snap' of '$storeid:$volname' does not exist\n"
            if !grep { $_ eq $snap } @snaps;
    }
    my @wanted;
    if ($with_snapshots) {
        # Every snapshot after the base (all of them without one), up to $snapshot
        # when the export is of that snapshot's moment.
        my $past_base = !defined($base_snapshot);
        for my $snap (@snaps) {
            if (!$past_base) {
                $past_base = $snap eq $base_snapshot;
                next;
            }
            push @wanted, $snap;
            last if defined($snapshot) && $snap eq $snapshot;
        }
        die "snapshot '$snapshot' of '$storeid:$volname' is not newer than the base"
            . " '$base_snapshot'\n"
            if defined($snapshot) && !grep { $_ eq $snapshot } @wanted;
    } elsif (defined($snapshot)) {
        @wanted = ($snapshot);
    }
    my @parts;
    my $base = $base_snapshot;
    for my $snap (@wanted) {
        push @parts, [$snap, $base];
        $base = $snap;
    }
    # The disk itself, unless the export is of a snapshot's moment.
    push @parts, [undef, $base] if !defined($snapshot);
    return @parts;
}

my sub stream_export {
    my ($scfg, $storeid, $fh, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my $what = "export of '$storeid:$volname'";
    my @parts = export_parts($scfg, $storeid, $volname, $snapshot, $base_snapshot,
        $with_snapshots);
    write_all($fh, $CONTAINER_MAGIC, $what);
    for my $part (@parts) {
        my ($snap, $base) = @$part;
        my @args = ('volume', 'send', pool_name($volname, $snap));
        push @args, '--from', pool_name($volname, $base) if defined($base);
        write_all($fh, 'part ' . encode_json({ snapshot => $snap, base => $base }) . "\n",
            $what);
        open(my $send, '-|', fewerbytes_command($scfg, @args))
            or die "$what: cannot run fewerbytes: $!\n";
        while (1) {
            my $n = sysread($send, my $chunk, $STREAM_CHUNK);
            die "$what: read failed: $!\n" if !defined($n);
            last if $n == 0;
            write_all($fh, pack('N', $n) . $chunk, $what);
        }
        close($send) or die "$what: `fewerbytes @args` failed (exit " . ($? >> 8) . ")\n";
        write_all($fh, pack('N', 0), $what);
    }
    write_all($fh, "end\n", $what);
    return undef;
}

# Receive one part's chunks from $fh into pool volume $into (from $base, a pool
# volume, if set); a failure abandons the partial volume.
my sub receive_part {
    my ($scfg, $fh, $into, $base, $what) = @_;
    my @args = ('volume', 'receive', $into);
    push @args, '--from', $base if defined($base);
    open(my $receive, '|-', fewerbytes_command($scfg, @args))
        or die "$what: cannot run fewerbytes: $!\n";
    my $ok = eval {
        while (1) {
            my $len = unpack('N', read_exactly($fh, 4, $what));
            last if $len == 0;
            die "$what: the stream is damaged (a chunk of $len bytes)\n"
                if $len > $STREAM_CHUNK;
            write_all($receive, read_exactly($fh, $len, $what), $what);
        }
        1;
    };
    my $err = $@;
    close($receive);
    my $status = $?;
    return if $ok && $status == 0;
    # A migration that failed is run again from its start: nothing is kept to resume.
    eval { fewerbytes($scfg, 'volume', 'receive', $into, '--abandon') };
    die $err if !$ok;
    die "$what: `fewerbytes @args` failed (exit " . ($status >> 8) . "); its error is above\n";
}

my sub stream_import {
    my ($class, $scfg, $storeid, $fh, $volname, $base_snapshot, $allow_rename) = @_;
    my (undef, undef, $vmid) = $class->parse_volname($volname);
    my $volumes = pool_volumes($scfg);
    my $target = $volname;
    if (defined($base_snapshot)) {
        # An increment onto the disk this storage holds (replication): its base
        # snapshot must be here.
        die "cannot import an increment into '$storeid:$volname': its base snapshot"
            . " '$base_snapshot' is not here\n"
            if !$volumes->{pool_name($volname, $base_snapshot)};
    } elsif ($volumes->{pool_name($volname)}) {
        die "volume '$storeid:$volname' already exists\n" if !$allow_rename;
        warn "volume '$storeid:$volname' already exists - importing with a different name\n";
        $target = free_disk_name($scfg, $storeid, $vmid, $volumes);
    }
    my $what = "import into '$storeid:$target'";
    die "$what: not a '$STREAM_FORMAT' export\n"
        if read_exactly($fh, length($CONTAINER_MAGIC), $what) ne $CONTAINER_MAGIC;
    my @made;
    my $disk_received;
    eval {
        while (1) {
            my $line = read_line($fh, $what);
            last if $line eq "end\n";
            die "$what: the stream is damaged (a part expected)\n"
                if $line !~ m/^part (\{.*\})\n\z/;
            my $part = decode_json($1);
            my ($snap, $base) = ($part->{snapshot}, $part->{base});
            for my $name (grep { defined } $snap, $base) {
                die "$what: the stream names snapshot '$name', not a Proxmox snapshot name\n"
                    if $name !~ m/^[A-Za-z0-9_\-]{1,40}$/;
            }
            die "$what: the stream carries the disk, which exists here\n"
                if !defined($snap) && pool_volumes($scfg)->{pool_name($target)};
            my $into = pool_name($target, $snap);
            receive_part($scfg, $fh, $into, defined($base) ? pool_name($target, $base) : undef,
                $what);
            push @made, $into;
            $disk_received = 1 if !defined($snap);
        }
        # An export of a snapshot's moment ends with that snapshot: the disk takes
        # its content (a new disk is a clone of it; one that exists, a replica, is
        # rolled back to it: refused while a VM has it open).
        if (!$disk_received) {
            my $last = $made[-1] // die "$what: the stream carries nothing\n";
            if (pool_volumes($scfg)->{pool_name($target)}) {
                fewerbytes($scfg, 'volume', 'rollback', pool_name($target), $last);
            } else {
                fewerbytes($scfg, 'volume', 'clone', $last, pool_name($target));
                push @made, pool_name($target);
            }
        }
        1;
    } or do {
        my $err = $@;
        for my $pool_name (reverse @made) {
            eval { fewerbytes($scfg, 'volume', 'delete', $pool_name) };
            warn $@ if $@;
        }
        die $err;
    };
    return "$storeid:$target";
}

my sub raw_size_only {
    my ($format, $base_snapshot, $with_snapshots) = @_;
    die "volume format '$format' is not available for a fewerbytes storage"
        . " ($STREAM_FORMAT, or raw+size without snapshots or a base)\n"
        if $format ne 'raw+size' || $with_snapshots || defined($base_snapshot);
}

# Snapshots and increments travel only in our own format; a plain disk in either.
sub volume_export_formats {
    my ($class, $scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    return ($STREAM_FORMAT) if $with_snapshots || defined($base_snapshot);
    return ($STREAM_FORMAT, 'raw+size');
}

sub volume_import_formats {
    my ($class, $scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    return ($STREAM_FORMAT) if $with_snapshots || defined($base_snapshot);
    return ($STREAM_FORMAT, 'raw+size');
}

sub volume_export {
    my ($class, $scfg, $storeid, $fh, $volname, $format, $snapshot, $base_snapshot,
        $with_snapshots) = @_;
    return stream_export($scfg, $storeid, $fh, $volname, $snapshot, $base_snapshot,
        $with_snapshots)
        if $format eq $STREAM_FORMAT;
    raw_size_only($format, $base_snapshot, $with_snapshots);
    my $name = pool_name($volname, $snapshot);
    my $size = fewerbytes_json($scfg, 'volume', 'info', $name)->{size_bytes};
    my $header = pack('Q<', $size);
    syswrite($fh, $header, 8) == 8 or die "export of '$storeid:$volname': write failed: $!\n";
    my $uri = scalar($class->path($scfg, $volname, $storeid, $snapshot));
    open(my $nbd, '-|', 'nbdcopy', '--', $uri, '-')
        or die "export of '$storeid:$volname': cannot run nbdcopy: $!\n";
    copy_exactly($nbd, $fh, $size, "export of '$storeid:$volname'");
    close($nbd) or die "export of '$storeid:$volname': nbdcopy failed (exit " . ($? >> 8) . ")\n";
    return undef;
}

sub volume_import {
    my ($class, $scfg, $storeid, $fh, $volname, $format, $snapshot, $base_snapshot,
        $with_snapshots, $allow_rename) = @_;
    my ($vtype, $name, $vmid) = $class->parse_volname($volname);
    die "cannot import '$volname': a fewerbytes storage holds disk images only\n"
        if $vtype ne 'images';
    return stream_import($class, $scfg, $storeid, $fh, $volname, $base_snapshot,
        $allow_rename)
        if $format eq $STREAM_FORMAT;
    raw_size_only($format, $base_snapshot, $with_snapshots);
    if (pool_volumes($scfg)->{pool_name($volname)}) {
        die "volume '$storeid:$volname' already exists\n" if !$allow_rename;
        warn "volume '$storeid:$volname' already exists - importing with a different name\n";
        $name = undef;
    }
    my $read = sysread($fh, my $header, 8);
    die "import into '$storeid': no size found in the stream's header\n"
        if !defined($read) || $read != 8;
    my $size = unpack('Q<', $header);
    die "import into '$storeid': the stream announces a disk of 0 bytes\n" if !$size;
    my $allocated = $class->alloc_image($storeid, $scfg, $vmid, 'raw', $name, ceil($size / 1024));
    eval {
        my $uri = scalar($class->path($scfg, $allocated, $storeid));
        open(my $nbd, '|-', 'nbdcopy', '--', '-', $uri)
            or die "import of '$storeid:$allocated': cannot run nbdcopy: $!\n";
        copy_exactly($fh, $nbd, $size, "import of '$storeid:$allocated'");
        close($nbd)
            or die "import of '$storeid:$allocated': nbdcopy failed (exit " . ($? >> 8) . ")\n";
    };
    if (my $err = $@) {
        eval { $class->free_image($storeid, $scfg, $allocated, 0, 'raw') };
        warn $@ if $@;
        die $err;
    }
    return "$storeid:$allocated";
}

# The clone is taken with the server's write gate held: the image of every write
# answered before it, as after a power cut. Ask the guest agent to freeze file systems.
sub volume_snapshot_needs_fsfreeze {
    return 1;
}

sub volume_qemu_snapshot_method {
    my ($class, $storeid, $scfg, $volname) = @_;
    return 'storage';
}

sub volume_has_feature {
    my ($class, $scfg, $feature, $storeid, $volname, $snapname, $running, $opts) = @_;

    my $features = {
        snapshot => { current => 1, snap => 1 },
        clone => { base => 1 },
        template => { current => 1 },
        copy => { base => 1, current => 1 },
        # A new volume reads as zeros: copies may skip zero blocks.
        sparseinit => { base => 1, current => 1 },
        rename => { current => 1 },
    };
    my (undef, undef, undef, undef, undef, $is_base) = $class->parse_volname($volname);
    my $key = $snapname ? 'snap' : $is_base ? 'base' : 'current';
    return $features->{$feature}->{$key} ? 1 : undef;
}

1;
